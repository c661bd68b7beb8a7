"""Issue 60: a compressed-tensors FP8 checkpoint with FP8 KV-cache scales (``kv_cache_scheme``,
per layer ``self_attn.k_scale`` / ``v_scale``), read as vLLM reads it: under
kv_cache_dtype="fp8" the cache holds k / k_scale and v / v_scale (jspec/checkpoint/kv_scales.py
folds the scales into the attention's weights), and a bf16 / f32 cache ignores them.

The scales are calibrated here from the unscaled cache (its largest |k| and |v| per layer over
200), so the scaled cache's values run up to ~200 where the unscaled one's stay near 1: the
check on the stored pages cannot pass unless the scales are applied. Llama with attention
biases (the scaled q / k / v biases) and Qwen3 (the q_norm / k_norm weights) both.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jspec
from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.checkpoint.target import flat_params
from tests.helpers.fp8 import with_kv_scales, write_fp8
from tests.helpers.targets import build_hf_model, random_prompt

KW = dict(max_num_seqs=1, max_model_len=64, page_size=8, dtype="float32", warmup=False, enable_prefix_caching=False)
PROMPT = random_prompt(np.random.default_rng(3), 20)
NEW = 8
_BUILT: dict = {}


def pages(llm):
    kv = llm.engine.runner.kv
    return [np.asarray(x, np.float32) for x in kv.k], [np.asarray(x, np.float32) for x in kv.v]


def run(folder, kv_cache_dtype="auto", max_tokens=NEW, logprobs=None):
    llm = jspec.LLM(folder, kv_cache_dtype=kv_cache_dtype, **KW)
    sp = jspec.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm, llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]


def with_scales(root, kind):
    """(an FP8 checkpoint without KV scales, the same with calibrated ones, the scales [(k, v)])."""
    if kind not in _BUILT:
        plain, _, _ = write_fp8(build_hf_model(kind), os.path.join(str(root), f"{kind}_kv"), "ct_channel")
        llm, _ = run(plain, max_tokens=1)  # the exact (float32) cache after the prompt's prefill
        ks, vs = pages(llm)
        scales = [(float(np.abs(k).max()) / 200, float(np.abs(v).max()) / 200) for k, v in zip(ks, vs)]
        _BUILT[kind] = (plain, with_kv_scales(plain, plain + "_scaled", scales), scales)
    return _BUILT[kind]


@pytest.mark.parametrize("kind", ["llama_untied", "qwen3"])
def test_the_fp8_cache_holds_k_and_v_over_their_scales(tmp_path_factory, kind):
    plain, scaled, scales = with_scales(tmp_path_factory.getbasetemp(), kind)
    exact_k, exact_v = pages(run(plain, max_tokens=1)[0])
    got_k, got_v = pages(run(scaled, "fp8", max_tokens=1)[0])
    for layer, (k_scale, v_scale) in enumerate(scales):
        for exact, got, s in ((exact_k[layer], got_k[layer], k_scale), (exact_v[layer], got_v[layer], v_scale)):
            # stored over the scale (up to ~200), not as it is (~1)
            assert 150 < np.abs(got).max() < 250, (layer, np.abs(got).max())
            if layer == 0:  # deeper layers' inputs went through the FP8 cache already: not the same k, v
                # e4m3: 3 mantissa bits (relative 2^-4 after rounding), subnormals below 2^-6 spaced 2^-9
                np.testing.assert_array_less(np.abs(got * s - exact), np.abs(exact) * 2**-4 + s * 2**-9 + 1e-12)


@pytest.mark.parametrize("kind", ["llama_untied", "qwen3"])
def test_greedy_with_checkpoint_scales_stays_with_the_exact_cache(tmp_path_factory, kind):
    """vLLM's standard for a lossy cache (its check_logprobs_close): the tokens equal, or where
    they first part, each run's token among the other's top 5; and up to there each token's
    logprob within 0.5 nats of the exact cache's (these random 2-3 layer models are flat, top
    logprobs near -3.5, so e4m3's rounding moves them by ~0.2 nats, 2026-11-30)."""
    plain, scaled, _ = with_scales(tmp_path_factory.getbasetemp(), kind)
    _, a = run(plain, logprobs=5)
    _, b = run(scaled, "fp8", logprobs=5)
    first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    for i in range(first):
        t = a.token_ids[i]
        assert abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) < 0.5, (i, a.logprobs[i], b.logprobs[i])
    if first < len(a.token_ids):
        la, lb, ta, tb = a.logprobs[first], b.logprobs[first], a.token_ids[first], b.token_ids[first]
        assert tb in la and ta in lb, (first, la, lb)


def test_an_unquantized_cache_ignores_the_scales(tmp_path_factory):
    plain, scaled, _ = with_scales(tmp_path_factory.getbasetemp(), "llama_untied")
    (la, a), (lb, b) = run(plain), run(scaled)
    pa, pb = flat_params(la.engine.runner.params), flat_params(lb.engine.runner.params)
    assert pa.keys() == pb.keys()
    assert all(np.array_equal(np.asarray(pa[k], np.float32), np.asarray(pb[k], np.float32)) for k in pa)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop("model.layers.1.self_attn.v_scale"), r"missing tensor 'model.layers.1.self_attn.v_scale'"),
    (lambda t: t.update({"model.layers.0.self_attn.k_scale": __import__("torch").tensor(-1.0)}),
     r"'model.layers.0.self_attn.k_scale' .* is -1.0: a KV-cache scale must be finite and > 0"),
    (lambda t: t.update({"model.layers.0.self_attn.k_scale": __import__("torch").ones(2)}),
     r"'model.layers.0.self_attn.k_scale' .* has shape \[2\]: a KV-cache scale is one number per layer")])
def test_bad_scales_name_the_tensor(tmp_path_factory, tmp_path, change, match):
    from safetensors.torch import load_file, save_file

    _, scaled, _ = with_scales(tmp_path_factory.getbasetemp(), "llama_untied")
    bad = str(tmp_path / "bad")
    shutil.copytree(scaled, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        jspec.LLM(bad, kv_cache_dtype="fp8", **KW)
