"""Issue 60: speculative decoding on an FP8 target is lossless: greedy with the n-gram method
and with a speculators EAGLE3 drafter (unquantized, in its own dtype) equals greedy without a
drafter, token for token. The target is the planted-feature Llama of tests/helpers/spec_e2e.py
as a compressed-tensors per-channel FP8 checkpoint (its feature survives quantization: the
embedding and lm_head are unquantized, the rows that carry it zero), so drafts are accepted.
"""

from __future__ import annotations

import os

import jax
import pytest

import jspec
from jspec.quantization import QuantWeight
from tests.helpers import spec_e2e as h
from tests.helpers.fp8 import write_fp8

MAX_TOKENS = 12
PROMPTS = h.varied_prompts(4, 1, 40, seed=3)
_CACHE: dict = {}


def fp8_target() -> str:
    if "folder" not in _CACHE:
        _CACHE["folder"] = write_fp8(h.build_target(), os.path.join(h._root(), "target_fp8"), "ct_channel")[0]
    return _CACHE["folder"]


def generate(spec):
    llm = jspec.LLM(fp8_target(), speculative_config=spec, **{**h.ENGINE_KW, "warmup": False})
    outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return llm.engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["ngram", "eagle3"])
def test_greedy_lossless_on_fp8_target(name):
    if "plain" not in _CACHE:
        _CACHE["plain"] = generate(None)[1]
    eng, got = generate(h.spec_config(name, 3))
    assert isinstance(eng.runner.params["layers_0"]["attn"]["qkv_proj"]["weight"], QuantWeight)
    if name == "eagle3":  # the drafter stays unquantized, in its own dtype
        leaves = jax.tree.leaves(eng.runner.dparams, is_leaf=lambda x: isinstance(x, QuantWeight))
        assert not any(isinstance(x, QuantWeight) for x in leaves)
        assert {x.dtype for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)} == {jax.numpy.dtype("float32")}
    assert got == _CACHE["plain"]
    assert eng.spec_metrics.mean_acceptance_length > 1.3, eng.spec_metrics.mean_acceptance_length
