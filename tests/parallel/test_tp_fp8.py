"""Issue 60: FP8 weights under tensor parallelism: greedy outputs at tp 2 and 4 equal tp 1's.

The tensor-parallel Llama (tests/helpers/parallel.py: 8 query heads, 2 KV heads) as a
compressed-tensors per-channel checkpoint (at tp 2 the per-shard layers, whose row-parallel
o_proj / down_proj hold their scales whole; at tp 4, KV heads replicated, XLA's partitioned
layers) and as a quant_method fp8 checkpoint of [8, 16] blocks (the block scales split by
block rows and columns), and quantization="fp8" at load. A block tp cannot split whole is
an error naming the tensor.
"""

from __future__ import annotations

import os

import pytest

import jspec
from tests.helpers import parallel as h
from tests.helpers.fp8 import with_kv_scales, write_fp8

PROMPTS = h.prompts(2, 6, 15, seed=0)
N = 12
_CACHE: dict = {}


def folder(fmt: str, block=(8, 16)) -> str:
    if (fmt, block) not in _CACHE:
        path = os.path.join(h._root(), f"tp_llama_{fmt}_{block[0]}x{block[1]}")
        _CACHE[(fmt, block)] = write_fp8(h.build_target("llama"), path, fmt, block)[0]
    return _CACHE[(fmt, block)]


def greedy(path, tp, **kw):
    llm = jspec.LLM(path, tensor_parallel_size=tp, **{**h.ENGINE_KW, **kw})
    return h.generate(llm, PROMPTS, N)


@pytest.mark.parametrize("fmt,tps", [("ct_channel", (2, 4)), ("fp8_block", (2,))])
def test_fp8_greedy_across_tp(fmt, tps):
    want = greedy(folder(fmt), 1)
    assert len({tuple(o) for o in want}) == len(want)
    for tp in tps:
        assert greedy(folder(fmt), tp) == want, f"{fmt} tp={tp}: greedy outputs differ from tp=1"


def test_online_fp8_across_tp_and_whole_blocks():
    path, _ = h.target("llama")
    assert greedy(path, 2, quantization="fp8") == greedy(path, 1, quantization="fp8")
    with pytest.raises(ValueError, match=r"tensor parallel size 4: axis 0 of tensor "
                                         r"'model.layers.0.self_attn.k_proj.weight' .* whole quantization blocks of 8"):
        jspec.LLM(folder("fp8_block"), tensor_parallel_size=4, **h.ENGINE_KW)


def test_an_fp8_kv_cache_across_tp():
    """kv_cache_dtype="fp8" at tp 2 (each device's KV heads in e4m3), with scales 1.0 and with the
    checkpoint's (folded into the sharded q / k / v / o weights as they load): tp 1's tokens."""
    scaled = folder("ct_channel") + "_kv_scales"  # per layer k 0.01, v 0.02
    if not os.path.isdir(scaled):
        with_kv_scales(folder("ct_channel"), scaled, [(0.01, 0.02)] * h.L)
    for path in (folder("ct_channel"), scaled):
        want = greedy(path, 1, kv_cache_dtype="fp8")
        assert greedy(path, 2, kv_cache_dtype="fp8") == want, path
