"""The shapes an engine compiles (jspec/engine/flat_input.py; with a drafter buckets.py and
spec_mixed.py), counted without a model: what a server's warmup compiles and logs at startup
(jspec.serve.cli.log_shapes)."""

from __future__ import annotations

from types import SimpleNamespace

from jspec.engine.buckets import Buckets
from jspec.engine.flat_input import FlatShapes, describe_shapes
from jspec.engine.flat_runner import FlatRunner
from jspec.engine.spec_mixed import mixed_shapes
from jspec.engine.spec_runner import SpecModelRunner
from jspec.ops import KernelPlan, page_table_widths
from jspec.serve.cli import build_parser, engine_kwargs, log_shapes


def server_shapes(attn: str, partial_prefills: int, *, max_num_seqs=64, max_model_len=1536, chunk=256, page=16,
                  K=0, lookahead=0):
    """K > 0: the speculative runner's (lookahead: the drafter's, which widens the page table)."""
    pages = -(-(max_model_len + lookahead) // page)
    b = Buckets.create(max_num_seqs, chunk, pages, max_prefill_rows=partial_prefills,
                       page_widths=page_table_widths(KernelPlan(attn=attn), pages))
    # the runners' warmup_shapes read nothing but their buckets (and K)
    if K:
        return SpecModelRunner.warmup_shapes(SimpleNamespace(buckets=b, K=K), 1, True)
    # LLMEngine's: the step budget, capped by the most tokens a step can hold
    budget = max(2048, max_num_seqs + chunk) if partial_prefills else max(chunk, max_num_seqs)
    most = max_num_seqs + partial_prefills * chunk if partial_prefills else max_num_seqs * chunk
    flat = FlatShapes.create(max_num_seqs, min(budget, most), chunk, 1)
    return FlatRunner.warmup_shapes(SimpleNamespace(shapes=flat), 1, True)


def test_8b_server_shape_count():
    """``--max-num-seqs 64 --max-model-len 1536``: the decode family (7 batch buckets, fed
    back) and the general family (token buckets 8 .. the step's budget), on every plan:
    the page table has one width. (The [B, Q] steps before were 252 shapes on the CPU plan,
    42 on the GPU's; 59 and 42 + 17 when mixing.)"""
    for attn in ("reference", "gpu"):
        assert describe_shapes(server_shapes(attn, 0)) == "13 shapes (7 decode, 6 general)"  # T 8 .. 256
        mixing = server_shapes(attn, 2)  # the engine's default max_num_partial_prefills
        assert describe_shapes(mixing) == "15 shapes (7 decode, 8 general)"  # T 8 .. 512, 576 (64 rows + 2 chunks)
    assert {(s.tokens, s.seqs, s.steps) for s in mixing if s.decode} == {(n, n, 1) for n in (1, 2, 4, 8, 16, 32, 64)}
    assert [(s.tokens, s.seqs) for s in mixing if not s.decode][:4] == [(8, 8), (16, 16), (32, 32), (64, 64)]


def test_8b_server_shapes_with_a_drafter():
    """EAGLE3 K = 3 (lookahead 3: 97 pages): verification and its chained form per batch
    bucket, prefill chunks, and when mixing (jspec/engine/spec_mixed.py) the mixed steps,
    whose decode segment is [B, K + 1]; prefill-only steps then take at most 2 rows."""
    unmixed = server_shapes("gpu", 0, K=3, lookahead=3)
    assert describe_shapes(unmixed) == "49 shapes (14 decode, 35 prefill)"  # 7 x (2 + 5)
    mixed = server_shapes("gpu", 2, K=3, lookahead=3)
    assert describe_shapes(mixed) == "66 shapes (14 decode, 42 mixed, 10 prefill)"
    assert {(s.q, s.pages, s.steps) for s in mixed if s.decode} == {(4, 97, 0), (4, 97, 1)}
    assert sorted({s.batch for s in mixed if not s.decode and not s.prefill_rows}) == [1, 2]
    assert [s for s in mixed if s.prefill_rows] == mixed_shapes(Buckets.create(64, 256, 97, max_prefill_rows=2,
                                                                                page_widths=(97,)))
    # the CPU plan: every width but for the mixed steps
    assert len(server_shapes("reference", 2, K=3, lookahead=3)) == (14 + 10) * 6 + 42


def test_mixed_buckets():
    b = Buckets.create(64, 256, 96, max_prefill_rows=3, page_widths=(96,))
    assert b.prefill_rows == (1, 2, 4)  # the batch buckets up to the one holding 3 rows
    assert b.mixed_q == (16, 64, 256)
    assert b.pages == (96,)
    assert len(mixed_shapes(b)) == 7 * 3 * 3
    none = Buckets.create(64, 256, 96)
    assert none.prefill_rows == none.mixed_q == () and mixed_shapes(none) == []
    assert none.pages == (4, 8, 16, 32, 64, 96)
    assert Buckets.create(8, 32, 4, max_prefill_rows=2).mixed_q == (16, 32)


def test_server_defaults_mix_and_log_the_shape_count(caplog):
    kw = engine_kwargs(build_parser().parse_args([]))
    assert (kw["max_num_partial_prefills"], kw["max_num_batched_tokens"], kw["max_prefill_chunk"]) == (2, None, 256)
    shapes = server_shapes("gpu", 2)
    with caplog.at_level("INFO", logger="jspec.serve"):
        line = log_shapes(SimpleNamespace(warmup_shapes=lambda: shapes))
    assert line == "15 shapes (7 decode, 8 general)" and line in caplog.text
