"""The kernel plan (jspec/ops.py) and the one environment module (jspec/envs.py): how
"auto" resolves, the JSPEC_KERNEL_IMPL override, the drafter's plan, which kernels a model
reaches through the plan on GPU (lowered on this CPU machine), and that no other module
reads the environment."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from jspec import envs, ops
from jspec.config import ModelConfig, RopeConfig
from jspec.kernel_backend import GPU, TPU, XLA, parse_impl, platform_kernels
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan, plan_kernels
from jspec.quantization import QuantConfig
from tests.helpers.lowering import custom_calls, lower

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA = ModelConfig(
    family="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(500000.0), tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, qk_norm=False, max_position_embeddings=4096,
)
QWEN3 = dataclasses.replace(LLAMA, family="qwen3", qk_norm=True, rms_norm_eps=1e-6)


def test_auto_resolves_by_backend(monkeypatch):
    monkeypatch.delenv("JSPEC_KERNEL_IMPL", raising=False)
    cpu = plan_kernels(LLAMA, backend="cpu")
    # the references (interpret mode is for tests, too slow to serve), weights held [in, out],
    # XLA:CPU's YNNPACK fusions off for the steps (jax 0.10.2 has the option)
    assert cpu == KernelPlan(in_out_weights=True, xla_options=(("xla_cpu_experimental_ynn_fusion_type", ""),))
    assert cpu.compiler_options == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert not plan_kernels(LLAMA, linear_impl="interpret", backend="cpu").in_out_weights  # kernels read [out, in]
    gpu = plan_kernels(LLAMA, backend="gpu")
    assert (gpu.attn, gpu.linear, gpu.sample, gpu.norm_handoff) == (GPU(), GPU(), GPU(), True)
    tpu = plan_kernels(LLAMA, backend="tpu")
    assert (tpu.attn, tpu.linear, tpu.sample, tpu.norm_handoff) == (TPU(), TPU(), TPU(), False)
    assert not gpu.in_out_weights and not tpu.in_out_weights  # HF [out, in] weights off the CPU
    assert gpu.compiler_options is None and tpu.compiler_options is None  # XLA's defaults there
    # an unquantized model's GPU steps of many rows: cuBLAS GEMMs, no autotuning while compiling;
    # weight-only FP8 weights keep XLA's defaults there, W8A8 ones its cuBLASLt GEMMs
    assert gpu.many_rows_options == {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
    assert tpu.many_rows_options is None and cpu.many_rows_options is None
    fp8 = dataclasses.replace(LLAMA, quantization=QuantConfig("fp8", "online"))
    assert plan_kernels(fp8, backend="gpu").many_rows_options is None
    # warmup compiles on several threads off the CPU (jspec/engine/warmup.py, prepare)
    assert cpu.compile_threads == 1 and gpu.compile_threads == tpu.compile_threads == min(8, os.cpu_count() or 1)
    # an impl named in the config wins; the hand-over needs the GPU projection kernels
    mixed = plan_kernels(LLAMA, attn_impl="interpret", linear_impl="reference", backend="gpu")
    assert (mixed.attn, mixed.linear, mixed.sample, mixed.norm_handoff) == (GPU(interpret=True), XLA(), GPU(), False)
    assert not plan_kernels(dataclasses.replace(LLAMA, mlp_bias=True), backend="gpu").norm_handoff
    with pytest.raises(ValueError, match=re.escape("linear_impl='cuda' is not one of ('reference', 'gpu', 'tpu', "
                                                   "'interpret', 'tpu_interpret', 'auto')")):
        plan_kernels(LLAMA, linear_impl="cuda")
    # each user-facing name is one typed backend, and names it back
    names = ("reference", "gpu", "tpu", "interpret", "tpu_interpret")
    backends = [parse_impl(n) for n in names]
    assert backends == [XLA(), GPU(), TPU(), GPU(interpret=True), TPU(interpret=True)] and parse_impl("auto") is None
    assert [b.name for b in backends] == list(names) and len(set(backends)) == 5
    assert [platform_kernels(b) for b in ("cuda", "rocm", "gpu", "tpu", "cpu")] == [GPU(), GPU(), GPU(), TPU(), XLA()]


def test_kernel_impl_override_through_envs(monkeypatch):
    monkeypatch.delenv("JSPEC_KERNEL_IMPL", raising=False)
    assert envs.JSPEC_KERNEL_IMPL is None
    unset = plan_kernels(LLAMA, backend="cpu")
    monkeypatch.setenv("JSPEC_KERNEL_IMPL", "auto")
    assert envs.JSPEC_KERNEL_IMPL is None and plan_kernels(LLAMA, backend="cpu") == unset
    monkeypatch.setenv("JSPEC_KERNEL_IMPL", " Interpret ")
    assert envs.JSPEC_KERNEL_IMPL == "interpret"
    plan = plan_kernels(LLAMA, sample_impl="reference", backend="cpu")
    assert (plan.attn, plan.linear, plan.sample) == (GPU(interpret=True), GPU(interpret=True), XLA())
    monkeypatch.setenv("JSPEC_KERNEL_IMPL", "bogus")
    with pytest.raises(ValueError, match="JSPEC_KERNEL_IMPL='bogus'"):
        plan_kernels(LLAMA, backend="cpu")
    monkeypatch.setenv("JSPEC_CACHE", "/somewhere")
    assert envs.JSPEC_CACHE == "/somewhere"
    with pytest.raises(AttributeError):
        envs.JSPEC_NORM_HANDOFF  # noqa: B018  (removed: the hand-over follows the plan)


def test_a_draft_model_runs_the_targets_kernels_at_the_drafters_tp():
    small = dataclasses.replace(LLAMA, hidden_size=2048, intermediate_size=8192, num_heads=32, head_dim=64)
    d = plan_kernels(LLAMA, backend="gpu").for_draft_model(small)
    assert (d.attn, d.linear, d.sample, d.norm_handoff, d.tp) == (GPU(), GPU(), GPU(), True, 1)
    assert not plan_kernels(LLAMA, backend="gpu").for_draft_model(dataclasses.replace(small, mlp_bias=True)).norm_handoff
    # a replicated draft model under a tp-2 target: XLA projections, tp 1
    r = dataclasses.replace(plan_kernels(LLAMA, backend="gpu"), tp=2, draft_tp=1).for_draft_model(small)
    assert (r.linear, r.norm_handoff, r.tp) == (XLA(), False, 1)
    hash(d)


def _forward_calls(cfg, plan, B, Q, dtype=jnp.bfloat16):
    """Kernel names in the lowered forward + logits of ``cfg`` under ``plan``, for cuda."""
    P, S, W = 8, 16, 2
    kv = KVCache.create(cfg.num_layers, P, S, cfg.num_kv_heads, cfg.head_dim, dtype)
    meta = AttentionMetadata(jnp.zeros((B, W), jnp.int32), jnp.full((B,), Q, jnp.int32),
                             jnp.tile(jnp.arange(Q, dtype=jnp.int32), (B, 1)), jnp.zeros((B, Q), jnp.int32),
                             jnp.ones((B,), bool))
    tok = jnp.zeros((B, Q), jnp.int32)
    params = jax.eval_shape(lambda: Transformer(cfg, dtype).init(jax.random.PRNGKey(0), tok, meta, kv))["params"]
    m = Transformer(cfg, dtype, plan)

    def step(params, tok, meta, kv):
        h, _, kv = m.apply({"params": params}, tok, meta, kv)
        return m.apply({"params": params}, h[:, -1], method=Transformer.logits), kv

    return [name for _, name in custom_calls(lower(step, (params, tok, meta, kv), "cuda"))]


@pytest.mark.parametrize("cfg,B,Q,expected", [
    # (either weight stream: which one is kernels_pallas/tuning.py's choice by shape)
    # batch-1 decode, no qk-norm: norm + qkv + RoPE + KV write in one kernel, attention,
    # o_proj + residual handing the norm over, down_proj + SwiGLU + residual (gate_up: XLA)
    (LLAMA, 1, 1, [r"qkv_rope_kv_write_p\d+_d\d+(_mma)?", r"paged_attention_gpu_\w+",
                   r"fused_linear_none_f\d+_d\d+(_mma)?_norm_out", r"fused_linear_silu_mul_f\d+_d\d+(_mma)?"]),
    # qk-norm: the qkv projection's kernel, then the RoPE + KV-write kernel
    (QWEN3, 1, 1, [r"fused_linear_rmsnorm_f\d+_d\d+(_mma)?", "rope_kv_write", r"paged_attention_gpu_\w+",
                   r"fused_linear_none_f\d+_d\d+(_mma)?_norm_out", r"fused_linear_silu_mul_f\d+_d\d+(_mma)?"]),
    # 2-16 rows (small batches, verification): layer 0's input norm and qkv through XLA, then
    # fused_linear_rows: o_proj and down_proj + residual handing the next norm over (one
    # lowered function: their weights have one shape here), gate_up + SwiGLU on the handed-over
    # norm, layer 1's qkv taking the norm down_proj handed over, the last down_proj. (Each
    # jitted kernel is lowered once.)
    (LLAMA, 2, 1, ["rope_kv_write", r"paged_attention_gpu_\w+", r"fused_linear_rows_r2_f\d+_d\d+_norm_out",
                   r"fused_linear_rows_r2_f\d+_d\d+_swiglu_norm_in", r"fused_linear_rows_r2_f\d+_d\d+_norm_in",
                   r"fused_linear_rows_r2_f\d+_d\d+"]),
    (QWEN3, 1, 4, ["rope_kv_write", r"paged_attention_gpu_\w+", r"fused_linear_rows_r4_f\d+_d\d+_norm_out",
                   r"fused_linear_rows_r4_f\d+_d\d+_swiglu_norm_in", r"fused_linear_rows_r4_f\d+_d\d+_norm_in",
                   r"fused_linear_rows_r4_f\d+_d\d+"]),
    # more rows (batches, verification, prefill): XLA projections around the two kernels
    (QWEN3, 2, 16, ["rope_kv_write", r"paged_attention_gpu_\w+"]),
])
def test_model_reaches_the_planned_gpu_kernels(cfg, B, Q, expected, gpu_target):
    names = _forward_calls(cfg, plan_kernels(cfg, backend="gpu"), B, Q)
    assert len(names) == len(expected) and all(re.fullmatch(e, n) for e, n in zip(expected, names)), names
    assert _forward_calls(cfg, KernelPlan(), B, Q) == []  # the reference plan: XLA only


def _sampling_calls(backend, platform):
    """Kernel names in ops.rejection_sample's lowering under a plan sampling on ``backend``."""
    B, K, V = 2, 3, 300
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((B, K + 1, V), jnp.float32), ((B, K), jnp.int32),
                                                      ((B,), jnp.int32), ((B, K, V), jnp.float32),
                                                      ((B,), jnp.float32), ((B,), jnp.int32), ((B,), jnp.float32),
                                                      ((B,), jnp.int32), ((B,), jnp.int32))]

    def fn(*a):
        return ops.rejection_sample(KernelPlan(sample=backend), *a, filtering="on")

    return [name for _, name in custom_calls(lower(fn, shapes, platform))]


def test_sampling_follows_the_plan_on_gpu(gpu_target):
    """ops.rejection_sample: the plan's sample backend picks the block kernels (the runner
    passes only the plan); XLA() lowers to plain XLA."""
    assert _sampling_calls(GPU(), "cuda") == ["rejection_stats_gpu", "rejection_resid_gpu"]
    assert _sampling_calls(XLA(), "cuda") == []


def test_sampling_follows_the_plan_on_tpu(tpu_chip):
    assert _sampling_calls(TPU(), "tpu") == ["rejection_stats_tpu", "rejection_resid_tpu"]


def test_environment_is_read_in_envs_only():
    """jspec/envs.py is the one module that reads os.environ (scripts and tests may set
    variables for subprocesses)."""
    readers = [str(p.relative_to(ROOT)) for d in ("jspec", "kernels_pallas") for p in sorted((ROOT / d).rglob("*.py"))
               if re.search(r"os\.environ|os\.getenv|\bgetenv\(", p.read_text())]
    assert readers == ["jspec/envs.py"]


def test_kernel_choice_lives_in_ops():
    """Model and engine code passes the plan on; only jspec/ops.py (and ops_attention.py)
    turns backends and shapes into a kernel choice, and no kernel file compares
    implementation names."""
    def offenders(dirs, pattern):
        return [str(p.relative_to(ROOT)) for d in dirs for p in sorted((ROOT / "jspec" / d).rglob("*.py"))
                if re.search(pattern, p.read_text())]

    assert offenders(("models", "drafters"), r"impl|kernel_backend|default_backend") == []
    assert offenders(("engine",), r"kernel_backend|\bimpl=|import .*\brejection_sample\b") == []
    kernel_files = sorted((ROOT / "kernels_pallas").glob("*.py"))
    names = r"\"(reference|interpret|tpu_interpret)\""
    assert [p.name for p in kernel_files if re.search(rf"\bimpl\b|[=!]= ?{names}|\bin \({names}", p.read_text())] == []
    assert ops.linear_kernel(KernelPlan(linear=GPU()), 1, (128, 128), fused=True)
    assert not ops.linear_kernel(KernelPlan(linear=TPU()), 1, (128, 128), fused=True)


def test_fp8_gemm_where_the_checkpoint_and_the_gpu_have_fp8_activations(monkeypatch):
    """KernelPlan.fp8_gemm (W8A8 GEMMs, jspec/ops.py): on a GPU with FP8 tensor cores (compute
    capability >= 8.9) for a checkpoint whose projections take FP8 activations (its
    input_activations, the "fp8" format, online FP8), unless JSPEC_FP8_GEMM=0; never for a
    weight-only or block-scaled checkpoint, an older GPU, the CPU or the TPU. Its steps of many
    rows compile without XLA's Triton GEMMs (many_rows_options); an unquantized model's without
    autotuning too, a weight-only FP8 one's with XLA's defaults."""
    from types import SimpleNamespace

    from jspec import kernel_plan
    from jspec.quantization import ONLINE, quant_config_from_hf
    from tests.helpers.fp8 import quant_config

    dev = lambda platform, cc: SimpleNamespace(platform=platform, compute_capability=cc)  # noqa: E731
    assert kernel_plan.fp8_tensor_cores(dev("gpu", "9.0")) and kernel_plan.fp8_tensor_cores(dev("gpu", "8.9"))
    assert kernel_plan.fp8_tensor_cores(dev("gpu", "10.0"))
    assert not kernel_plan.fp8_tensor_cores(dev("gpu", "8.0"))
    assert not kernel_plan.fp8_tensor_cores(dev("gpu", "gfx942"))
    assert not kernel_plan.fp8_tensor_cores(dev("tpu", None)) and not kernel_plan.fp8_tensor_cores(jax.devices()[0])
    ct = quant_config("ct_channel")
    w8a16 = {**ct, "config_groups": {"group_0": {**ct["config_groups"]["group_0"], "input_activations": None}}}
    channel, weight_only, block = map(quant_config_from_hf, (ct, w8a16, quant_config("fp8_block")))
    assert channel.activations and not weight_only.activations and block.activations and ONLINE.activations
    for cores, env in ((True, None), (True, "1"), (False, "1"), (True, "0"), (True, "false")):
        monkeypatch.setattr(kernel_plan, "fp8_tensor_cores", lambda device=None, c=cores: c)
        if env is None:
            monkeypatch.delenv("JSPEC_FP8_GEMM", raising=False)  # on by default (jspec/envs.py)
        else:
            monkeypatch.setenv("JSPEC_FP8_GEMM", env)
        for q, want in ((channel, cores), (ONLINE, cores), (weight_only, False), (block, False), (None, False)):
            cfg = dataclasses.replace(LLAMA, quantization=q)
            plan = plan_kernels(cfg, backend="gpu")
            on = want and env in (None, "1")
            assert plan.fp8_gemm is on, (q, cores, env)
            unquantized = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
            assert plan.many_rows_options == ({"xla_gpu_enable_triton_gemm": False} if on else
                                              unquantized if q is None else None)
            assert plan_kernels(cfg, backend="cpu").fp8_gemm is False and not plan_kernels(cfg, backend="tpu").fp8_gemm
            assert plan_kernels(cfg, backend="cpu").many_rows_options is None
