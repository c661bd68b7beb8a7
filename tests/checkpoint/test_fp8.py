"""Issue 60: FP8 checkpoints (weight-only) load and run on the XLA path.

Each format (compressed-tensors per channel / per tensor with static input scales / per
block, quant_method fp8 per block) of tiny Llama, Qwen3 and Qwen3-MoE targets, written by
tests/helpers/fp8.py with torch's quantizer: jspec's greedy tokens from the FP8 folder equal
transformers' from a plain folder of the dequantized weights (float32). quantization="fp8"
quantizes an unquantized checkpoint (or dummy weights) per channel as it loads; bad scales
and configs jspec cannot serve are errors naming the tensor or the key.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.checkpoint.target import flat_params, load_target
from jspec.config import ConfigError, model_config_from_hf
from jspec.quantization import QuantWeight
from tests.helpers.fp8 import quant_config, write_fp8
from tests.helpers.targets import build_hf_model, hf_config, hf_greedy, random_prompt

NEW = 8


def llama128():
    """A Llama whose fused parts are whole [128, 128] blocks of rows (q, k, v, gate, up: 128)
    over a hidden size of 64: the blocks of every input column, and of o_proj's and down_proj's
    64 rows, are partial."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.drafters import fill_random

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        fill_random(m, scale=0.15)
    return m


_BUILT: dict = {}


def fp8_folder(root, kind: str, fmt: str, block=(128, 128)):
    """(fp8 folder, dequantized folder, transformers' model of the dequantized weights), once per session."""
    key = (kind, fmt, block)
    if key not in _BUILT:
        model = llama128() if kind == "llama128" else build_hf_model(kind)
        _BUILT[key] = write_fp8(model, os.path.join(str(root), f"{kind}_{fmt}_{block[0]}x{block[1]}"), fmt, block)
    return _BUILT[key]


CASES = [("llama_untied", "ct_channel", (128, 128)),  # attention and MLP biases (unquantized)
         ("qwen3", "ct_tensor", (128, 128)),  # per tensor, static input_scale tensors present (unread)
         ("llama128", "fp8_block", (128, 128)),  # partial blocks at the edges
         ("qwen3", "fp8_block", (16, 24)),
         ("qwen3_moe", "ct_block", (16, 16))]  # stacked experts; the router unquantized


@pytest.mark.parametrize("kind,fmt,block", CASES, ids=[f"{k}-{f}-{b[0]}x{b[1]}" for k, f, b in CASES])
def test_greedy_matches_transformers_on_dequantized_weights(ckpt_root, kind, fmt, block):
    folder, _, ref = fp8_folder(ckpt_root, kind, fmt, block)
    llm = jspec.LLM(folder, max_num_seqs=1, max_model_len=64, page_size=8)
    qc = llm.engine.model_cfg.quantization
    assert qc is not None and qc.method == ("fp8" if fmt.startswith("fp8") else "compressed-tensors")
    leaves = flat_params(llm.engine.runner.params)
    fp8 = [k for k, v in leaves.items() if v.dtype == jax.numpy.float8_e4m3fn]
    assert fp8 and all("embed" not in k and "lm_head" not in k and "mlp/gate/" not in k for k in fp8)
    prompt = random_prompt(np.random.default_rng(0), 12)
    out = llm.generate([prompt], jspec.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW)


def test_online_fp8_is_the_per_channel_checkpoint(ckpt_root):
    """quantization="fp8" on the unquantized folder holds the same FP8 weights as the
    compressed-tensors per-channel checkpoint torch's quantizer wrote of it, and its scales
    (amax / 448) to the last bit (XLA divides by 448 as a multiplication by its inverse)."""
    folder, _, _ = fp8_folder(ckpt_root, "llama_untied", "ct_channel")
    _, online = load_target(folder + "_src", quantization="fp8")
    _, stored = load_target(folder)
    a, b = flat_params(online), flat_params(stored)
    assert a.keys() == b.keys() and any(v.dtype == jax.numpy.float8_e4m3fn for v in a.values())
    for k in a:
        x, y = np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)
        assert a[k].dtype == b[k].dtype, k
        if k.endswith(".scale"):
            np.testing.assert_allclose(x, y, rtol=2e-7, err_msg=k)
        else:
            assert np.array_equal(x, y), k


def test_pytorch_bin_reads_the_same(ckpt_root, tmp_path):
    """The FP8 checkpoint as pytorch_model.bin (torch's float8_e4m3fn tensors) loads the same tree."""
    import torch
    from safetensors.torch import load_file

    folder, _, _ = fp8_folder(ckpt_root, "qwen3", "fp8_block", (16, 24))
    shutil.copy(os.path.join(folder, "config.json"), tmp_path)
    torch.save(load_file(os.path.join(folder, "model.safetensors")), tmp_path / "pytorch_model.bin")
    a, b = flat_params(load_target(folder)[1]), flat_params(load_target(str(tmp_path))[1])
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)), k


def test_dummy_weights_quantized(ckpt_root):
    folder, _, _ = fp8_folder(ckpt_root, "qwen3", "ct_tensor")
    llm = jspec.LLM(folder + "_src", load_format="dummy", quantization="fp8", max_num_seqs=1, max_model_len=64,
                    page_size=8)
    w = llm.engine.runner.params["layers_0"]["mlp"]["gate_up_proj"]["weight"]
    assert isinstance(w, QuantWeight) and w.w.dtype == jax.numpy.float8_e4m3fn and w.block is None
    out = llm.generate([[5, 6, 7]], jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_checkpoints_name_the_tensor(ckpt_root, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _, _ = fp8_folder(ckpt_root, "llama_untied", "ct_channel")
    bad = str(tmp_path / "bad")
    shutil.copytree(folder, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'{name}' .* shape \[63, 1\], expected \[64, 1\]"):
        load_target(bad)
    # FP8 weights under a config.json without quantization_config: not read as plain floats
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.weight' .* stored as F8_E4M3"):
        load_target(bad)
    # a fused part (q_proj, 64 rows) that is not whole blocks of 128 rows
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.weight' has 64 rows, not a "
                                              r"multiple of the quantization block's 128"):
        fp8_folder(tmp_path, "llama_untied", "fp8_block")
        load_target(str(tmp_path / "llama_untied_fp8_block_128x128"))


def test_quantization_argument_and_unsupported_configs(ckpt_root):
    folder, _, _ = fp8_folder(ckpt_root, "llama_untied", "ct_channel")
    for value, match in [("fp8", "quantization='fp8' does not match the checkpoint .* 'compressed-tensors'"),
                         ("awq", "quantization='awq' is not supported")]:
        with pytest.raises(ValueError, match=match):
            load_target(folder, quantization=value)
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs a compressed-tensors checkpoint"):
        load_target(folder + "_src", quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization='gptq' is not supported: jspec serves FP8 weights"):
        jspec.LLM(folder, quantization="gptq")
    base = hf_config("llama_untied").to_dict()
    ct = quant_config("ct_channel")
    weights = ct["config_groups"]["group_0"]["weights"]
    bad = [({"quant_method": "awq"}, r"quant_method='awq' is not supported"),
           ({**ct, "format": "pack-quantized"}, r"format='pack-quantized' is not supported"),
           ({**ct, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"}},
            r"kv_cache_scheme.strategy='channel' is not supported"),
           ({**ct, "kv_cache_scheme": {"num_bits": 8, "dynamic": True}}, r"kv_cache_scheme.dynamic=True is not supported"),
           ({**ct, "kv_cache_scheme": "fp8"}, r"kv_cache_scheme='fp8': an object expected"),
           ({**ct, "config_groups": {"group_0": {**ct["config_groups"]["group_0"],
                                                 "weights": {**weights, "num_bits": 4, "type": "int"}}}},
            r"config_groups.group_0.weights.num_bits=4 is not supported"),
           ({**ct, "config_groups": {"group_0": {**ct["config_groups"]["group_0"],
                                                 "weights": {**weights, "strategy": "group", "group_size": 128}}}},
            r"config_groups.group_0.weights.group_size=128 is not supported"),
           ({**quant_config("fp8_block"), "fmt": "e5m2"}, r"quantization_config.fmt='e5m2' is not supported"),
           ({**quant_config("fp8_block"), "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
           ({**quant_config("fp8_block"), "new_key": 1}, r"new_key=1 is not supported for quant_method 'fp8'")]
    for qc, match in bad:
        with pytest.raises(ConfigError, match=match) as e:
            model_config_from_hf({**base, "quantization_config": qc})
        assert str(e.value).startswith("config.json: quantization_config."), e.value


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("block", [None, (16, 24), (32, 32)])
def test_fp8_dots_equal_the_dequantized_weight(rows, block):
    """ops.linear on FP8 weights in HF's [out, in] layout (the GPU plan's), each form
    (per-channel scale on the f32 result; a block scale's row blocks up to
    FP8_BLOCK_DOT_ROWS rows, dequantized first beyond) == x @ dequantize(w).T in float32,
    with a bias and a residual; float32 activations, so only the summation order differs."""
    import jax.numpy as jnp

    from jspec import ops
    from jspec.quantization import quantize_fp8

    rng = np.random.default_rng(rows)
    F, K = 96, 88  # K: a partial column block at the edge for (16, 24)
    w = quantize_fp8(jnp.asarray(rng.normal(size=(F, K)) * 0.1, jnp.float32), block)
    x = jnp.asarray(rng.normal(size=(rows, K)), jnp.float32)
    b, res = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((F,), (rows, F)))
    want = res + (np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64).T + b)
    got = ops.linear(ops.KernelPlan(), x, w, b, residual=res)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    normed = ops.Normed(x, jnp.asarray(rng.normal(size=(K,)), jnp.float32), 1e-6)
    want = np.asarray(normed.value(), np.float64) @ np.asarray(w.dequantize(), np.float64).T
    np.testing.assert_allclose(np.asarray(ops.linear(ops.KernelPlan(), normed, w)), want, rtol=2e-5, atol=2e-5)


def test_w8a8_steps_of_many_rows_compile_with_the_plans_options(ckpt_root, monkeypatch):
    """Under a plan with fp8_gemm (a GPU with FP8 tensor cores; forced here) a step of more
    than FP8_GEMM_MIN_ROWS tokens compiles with the plan's many_rows_xla_options added (no
    Triton GEMMs: cuBLASLt's FP8 GEMM, compiled without autotuning Triton's FP8
    configurations), a step of fewer tokens with the jitted function's own, through the same
    three jitted functions. (W8A8's own maths: tests/kernels/test_fp8_kernels.py and the GPU
    line; its tokens may part from weight-only's at near-ties, so none are compared here.)"""
    import dataclasses

    from jspec.engine import llm_engine
    from jspec.ops import FP8_GEMM_MIN_ROWS

    folder, _, _ = fp8_folder(ckpt_root, "llama_untied", "ct_channel")
    prompt = random_prompt(np.random.default_rng(1), FP8_GEMM_MIN_ROWS + 4)
    sp = jspec.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    kw = dict(max_num_seqs=1, max_model_len=64, page_size=8)
    plan_kernels = llm_engine.plan_kernels
    monkeypatch.setattr(llm_engine, "plan_kernels", lambda *a, **k: dataclasses.replace(  # plan_kernels on such a GPU
        plan_kernels(*a, **k), fp8_gemm=True, many_rows_xla_options=(("xla_gpu_enable_triton_gemm", False),)))
    llm = jspec.LLM(folder, **kw)
    r = llm.engine.runner
    assert not hasattr(r, "_step_many") and r.plan.many_rows_options["xla_gpu_enable_triton_gemm"] is False
    calls, compiled = [], []
    invoke = r._invoke_here
    monkeypatch.setattr(r, "_invoke_here", lambda name, args, kw: calls.append((name, r.compile_options(kw)))
                        or invoke(name, args, kw))
    from jax.stages import Lowered

    lowered_compile = Lowered.compile
    monkeypatch.setattr(Lowered, "compile", lambda self, options=None, **k: compiled.append(options)
                        or lowered_compile(self, options, **k))
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    many = {"xla_gpu_enable_triton_gemm": False}
    # the prompt's step, then one-row decodes
    assert calls[0] == ("_step", many) and {c for c in calls[1:]} == {("_step", None)}, calls
    assert compiled.count(many) == 1, compiled  # the prompt's step, compiled once with them
    assert len(got) == NEW
