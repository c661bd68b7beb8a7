"""A gpt-oss target (GptOssForCausalLM) through the engine, against transformers' own model:
attention sinks, sliding-window layers (window 8, contexts up to 56), YaRN RoPE, biases,
experts in every layer with the clamped SwiGLU, the checkpoint's interleaved gate|up, and
its experts shipped as MXFP4 blocks and scales (quantized here, compared with transformers
on the dequantized weights); bf16 checkpoints, run in float32 on both sides. Speculative greedy equals plain greedy with EAGLE3 (a
speculators drafter reading its hidden states), DFlash and n-gram; sampled output with
EAGLE3 follows the target's distribution (chi-squared). Config translation and its errors.

The target carries tests/helpers/spec_e2e.py's planted feature (no layer reads or writes
residual dimension F: o_proj's and the experts' down rows and biases at F are zero), so the
drafters agree with it often enough for accepts to happen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from jspec.config import ConfigError, model_config_from_hf
from jspec.mxfp4 import Mxfp4Weight
from tests.helpers import gpt_oss
from tests.helpers import spec_e2e as h
from tests.helpers.gpt_oss import WINDOW
from tests.helpers.targets import hf_greedy

MAX_TOKENS = 16
PROMPTS = h.varied_prompts(4, 1, 40, seed=7)
ENGINE_KW = {**h.ENGINE_KW, "num_pages": 8}
PROMPT = [9, 33, 17, 50, 12, 41]
TRIALS = 1200


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """{"target", "mxfp4", "eagle3", "dflash4": folders; "hf", "hf_mxfp4": torch models}."""
    return gpt_oss.build(str(tmp_path_factory.mktemp("gpt_oss")))


def _greedy(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                             ignore_eos=True))]


def test_plain_greedy_equals_transformers(oss):
    llm = jspec.LLM(oss["target"], **ENGINE_KW)
    c = llm.engine.runner.cfg
    assert c.dtype == "bfloat16"  # the checkpoint's (run in float32 on the CPU)
    assert c.family == "gpt_oss" and c.sliding_layers == (0, 2) and c.window(0) == WINDOW and c.window(1) == 0
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > 4 * WINDOW  # contexts well past the window
    for p, got in zip(PROMPTS, _greedy(llm)):
        assert got == hf_greedy(oss["hf"], p, MAX_TOKENS), f"prompt of length {len(p)}"


def test_plain_greedy_on_the_gpu_kernels_equals_transformers(oss, monkeypatch):
    """With the GPU plan (kernel bodies in Pallas' interpreter, as on a GPU) decode rows take
    the paged-attention kernel and prompts the ragged one, with sinks, on the sliding layers
    with their window too."""
    from kernels_pallas import paged_attention_gpu, ragged_paged_attention_gpu

    traced = []

    def recording(name, real):
        def call(*a, **k):
            traced.append((name, k.get("window", 0), len(a) > 7 and a[7] is not None))
            return real(*a, **k)
        return call

    for module in (paged_attention_gpu, ragged_paged_attention_gpu):
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    llm = jspec.LLM(oss["target"], attn_impl="interpret", linear_impl="interpret", **ENGINE_KW)
    for p, got in zip(PROMPTS[:2], [o.token_ids for o in llm.generate(
            PROMPTS[:2], jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]):
        assert got == hf_greedy(oss["hf"], p, MAX_TOKENS), f"prompt of length {len(p)}"
    assert {(k, w, True) for k in ("paged_attention_gpu", "ragged_paged_attention_gpu") for w in (WINDOW, 0)} \
        <= set(traced), traced


def test_mxfp4_experts_equal_transformers_on_their_dequantized_weights(oss):
    llm = jspec.LLM(oss["mxfp4"], **ENGINE_KW)
    assert llm.engine.runner.cfg.mxfp4
    experts = [w for w in jax.tree.leaves(llm.engine.runner.params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))
               if isinstance(w, Mxfp4Weight)]
    assert len(experts) == 2 * llm.engine.runner.cfg.num_layers  # gate_up and down, kept packed
    assert all(w.blocks.dtype == jnp.uint8 for w in experts)
    for p, got in zip(PROMPTS, _greedy(llm)):
        assert got == hf_greedy(oss["hf_mxfp4"], p, MAX_TOKENS), f"prompt of length {len(p)}"


@pytest.mark.parametrize("method", ["eagle3", "eagle3_orig", "dflash", "ngram"])
def test_speculative_greedy_equals_plain(oss, method):
    spec = {"eagle3": {"method": "eagle3", "model": oss["eagle3"], "num_speculative_tokens": 3},
            "eagle3_orig": {"method": "eagle3", "model": oss["eagle3_orig"], "num_speculative_tokens": 3},
            "dflash": {"method": "dflash", "model": oss["dflash4"], "num_speculative_tokens": 3},
            "ngram": h.spec_config("ngram", 3)}[method]
    llm = jspec.LLM(oss["target"], speculative_config=spec, **ENGINE_KW)
    before = llm.engine.stats()
    for p, got in zip(PROMPTS, _greedy(llm)):
        assert got == hf_greedy(oss["hf"], p, MAX_TOKENS), f"prompt of length {len(p)}"
    d = h.stats_delta(before, llm.engine.stats())
    assert d["mean_acceptance_length"] > 1.2, d  # accepts happened: not every draft rejected


def test_sampled_output_follows_the_target(oss):
    """EAGLE3, temperature 1: the first and second tokens (each verified, or a bonus) follow
    transformers' distribution, and not the distribution at temperature 0.7."""
    llm = jspec.LLM(oss["target"], speculative_config={"method": "eagle3", "model": oss["eagle3"],
                                                       "num_speculative_tokens": 3}, **ENGINE_KW)
    toks = h.sample_trials(llm.engine, PROMPT, TRIALS, 2)

    def probs(ctx, temperature=1.0):
        ids = torch.as_tensor(np.concatenate([np.tile(PROMPT, (len(ctx), 1)), ctx], 1))
        with torch.no_grad():
            return torch.softmax(oss["hf"](ids).logits[:, -1].double() / temperature, -1).numpy()

    for j in (0, 1):
        ctx, inverse = np.unique(toks[:, :j], axis=0, return_inverse=True)
        counts = np.bincount(toks[:, j], minlength=h.V).astype(np.float64)
        p, df = h.chi2_pvalue(counts, probs(ctx)[inverse.reshape(-1)].sum(0))
        p_wrong, _ = h.chi2_pvalue(counts, probs(ctx, 0.7)[inverse.reshape(-1)].sum(0))
        assert p > 1e-3 and p_wrong < 1e-6, (j, p, df, p_wrong)


def _hf(**kw):
    d = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
         "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True,
         "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096}, "rope_theta": 150000,
         "experts_per_token": 2, "initial_context_length": 4096, "swiglu_limit": 7.0}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not None}


def test_config_as_gpt_oss_ships_it():
    """The keys of gpt-oss-20b's config.json (rope_scaling, experts_per_token, MXFP4)."""
    c = model_config_from_hf(_hf(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []}))
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_layers, c.sliding_layers) == \
        ("gpt_oss", 4, 2, (0, 1, 2, 3), (0, 2))
    assert c.mxfp4 and c.quantization is None and c.attention_sinks and c.moe_bias and c.norm_topk_prob
    assert c.rope.rope_type == "yarn" and abs(c.rope.attention_factor - (0.1 * np.log(32) + 1)) < 1e-12


@pytest.mark.parametrize("bad,match", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8' is not supported for model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position_embeddings is required"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "low": 1}},
     r"rope_scaling.low is not supported"),
])
def test_config_errors_name_the_key(bad, match):
    d = _hf(**bad)
    if "rope_scaling" in bad and "original_max_position_embeddings" not in bad["rope_scaling"]:
        d.pop("initial_context_length")
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf(d)


def test_dummy_weights_are_the_loaded_tree_packed_alike(oss, tmp_path):
    """load_format="dummy" (the benchmarks' 20b / 120b shapes): the same leaves, shapes and
    dtypes as the MXFP4 checkpoint's, experts packed."""
    import shutil

    from jspec.checkpoint.target import load_target

    shutil.copy(f"{oss['mxfp4']}/config.json", tmp_path / "config.json")
    shapes = lambda t: {jax.tree_util.keystr(k): (v.shape, str(v.dtype))  # noqa: E731
                        for k, v in jax.tree_util.tree_leaves_with_path(t)}
    _, real = load_target(oss["mxfp4"], "bfloat16")
    _, dummy = load_target(str(tmp_path), "bfloat16", load_format="dummy")
    assert shapes(dummy) == shapes(real)
    assert any(s == "uint8" for _, s in shapes(dummy).values())
