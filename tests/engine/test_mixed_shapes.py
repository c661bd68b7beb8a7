"""The shapes an engine compiles (jspec/engine/flat_input.py), counted without a model: what
a server's warmup compiles and logs at startup (jspec.serve.cli.log_shapes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jspec.engine.flat_input import FlatShapes, describe_shapes
from jspec.engine.flat_runner import FlatRunner
from jspec.serve.cli import build_parser, engine_kwargs, log_shapes

pytestmark = pytest.mark.production_buckets  # about the real shape buckets (tests/conftest.py)


def server_shapes(partial_prefills: int, *, max_num_seqs=64, chunk=256, K=0):
    """The shapes of a server's engine, as LLMEngine makes its FlatShapes: the step budget
    capped by the most tokens a step can hold (K > 0: a drafter's rows of K + 1)."""
    budget = max(2048, max_num_seqs * (K + 1) + chunk) if partial_prefills else max(chunk, max_num_seqs)
    most = max_num_seqs * (K + 1) + partial_prefills * chunk if partial_prefills else max_num_seqs * chunk
    flat = FlatShapes.create(max_num_seqs, min(budget, most), chunk, K + 1)
    # the runner's warmup_shapes read nothing but its shapes and K
    return FlatRunner.warmup_shapes(SimpleNamespace(shapes=flat, K=K), 1, True)


def test_8b_server_shape_count():
    """``--max-num-seqs 64``: the decode family (7 batch buckets, fed back) and the general
    family (token buckets 8 .. the most a step holds), whatever the plan: the page table has
    one width. (The [B, Q] steps before were 252 shapes on the CPU plan at max_model_len
    1536, 42 on the GPU's; 59 and 42 + 17 when mixing.)"""
    # each shape twice: without and with top-k / top-p filtering
    assert describe_shapes(server_shapes(0)) == "26 shapes (7 decode, 7 decode filtering, 6 general, " \
                                                "6 general filtering)"  # T 8 .. 256
    mixing = server_shapes(2)  # the engine's default max_num_partial_prefills
    assert len(mixing) == 2 * (7 + 8)  # T 8 .. 512, 576 (64 rows + 2 chunks)
    assert {(s.tokens, s.seqs, s.steps) for s in mixing if s.decode} == {(n, n, 1) for n in (1, 2, 4, 8, 16, 32, 64)}
    assert [(s.tokens, s.seqs) for s in mixing if not s.decode][:4] == [(8, 8), (16, 16), (32, 32), (64, 64)]


def test_8b_server_shapes_with_a_drafter():
    """EAGLE3 K = 3: the verification step of [N, 4] rows per batch bucket (one program,
    chained or not), and the general family (prefill chunks, and when mixing verification
    rows beside them), each without and with filtering. (The [B, Q] steps before: 49 shapes,
    66 when mixing, without their filtering variants.)"""
    assert len(server_shapes(0, K=3)) == 2 * (7 + 6)
    mixed = server_shapes(2, K=3)
    assert len(mixed) == 2 * (7 + 8)  # T 8 .. 512, 768 (64 x 4 + 2 x 256)
    assert {(s.tokens // s.seqs, s.steps) for s in mixed if s.decode} == {(4, 1)}


def test_server_defaults_mix_and_log_the_shape_count(caplog):
    kw = engine_kwargs(build_parser().parse_args([]))
    assert (kw["max_num_partial_prefills"], kw["max_num_batched_tokens"], kw["max_prefill_chunk"]) == (2, None, 256)
    shapes = server_shapes(2)
    with caplog.at_level("INFO", logger="jspec.serve"):
        line = log_shapes(SimpleNamespace(warmup_shapes=lambda: shapes))
    assert line == "30 shapes (7 decode, 7 decode filtering, 8 general, 8 general filtering)" and line in caplog.text
