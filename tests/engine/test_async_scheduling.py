"""Async scheduling: a decode call dispatched before the previous one is read.

The chained call runs past sequences that stop inside the call before it, and writes KV into
pages that are freed (and handed to the next request) while it is still queued. The outputs
must be those of the synchronous engine and of transformers, token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers.engine import drive
from tests.helpers.targets import hf_greedy, random_prompt

KW = dict(max_num_seqs=2, max_model_len=128, page_size=16, num_pages=20, enable_prefix_caching=True)


@pytest.mark.parametrize("steps", [1, 4])
def test_async_scheduling_matches_sync_and_transformers(llama_ckpt, steps):
    path, hf = llama_ckpt
    rng = np.random.default_rng(11)
    prefix = random_prompt(rng, 40)
    p0, p1, p2 = prefix + random_prompt(rng, 3), random_prompt(rng, 9), prefix + random_prompt(rng, 5)
    sync = jspec.LLM(path, async_scheduling=False, num_scheduler_steps=steps, **KW)
    asyn = jspec.LLM(path, async_scheduling=True, num_scheduler_steps=steps, **KW)
    greedy = dict(temperature=0.0, ignore_eos=True)
    ref0 = hf_greedy(hf, p0, 24)
    # r0 stops at the token it emits sixth: inside the second 4-token call, while the call
    # after it is already queued (and writes past the stop into pages freed right after).
    stop = jspec.SamplingParams(max_tokens=24, stop_token_ids=[ref0[5]], **greedy)
    cut = ref0.index(ref0[5]) + 1
    sampled = jspec.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, seed=5, ignore_eos=True)
    long = jspec.SamplingParams(max_tokens=17, **greedy)
    script = {
        0: [("add", "r0", p0, stop), ("add", "r1", p1, sampled)],
        # r2 arrives while r0 and r1 decode; it shares r0's 40-token prefix (2 full pages).
        6: [("add", "r2", p2, long)],
        # r3 is aborted mid-decode, while a call chained for it may still be queued.
        9: [("add", "r3", p1, jspec.SamplingParams(max_tokens=50, **greedy)), ("abort", "r3", 3)],
    }
    outs = {name: drive(llm, script) for name, llm in (("sync", sync), ("async", asyn))}
    for rid in ("r0", "r1", "r2"):
        assert outs["async"][rid] == outs["sync"][rid], rid
    assert outs["async"]["r0"] == (ref0[:cut], "stop")
    assert outs["async"]["r2"] == (hf_greedy(hf, p2, 17), "length")
    assert len(outs["async"]["r1"][0]) == 30
    # r3 was aborted: what it emitted is the start of its uninterrupted output.
    r3 = outs["async"]["r3"][0]
    assert len(r3) >= 3 and r3 == hf_greedy(hf, p1, 50)[: len(r3)]
    stats = asyn.engine.stats()
    assert stats["num_chained_calls"] > 0 and sync.engine.stats()["num_chained_calls"] == 0
    assert stats["prefix_cache_hits"] > 0  # r2 read r0's pages
    for llm in (sync, asyn):
        assert llm.engine.num_free_pages == llm.engine.num_pages
    # The engine, drained, serves again: a dangling chained call is read and dropped.
    again = asyn.generate([p0], jspec.SamplingParams(max_tokens=10, **greedy))[0]
    assert again.token_ids == ref0[:10]


@pytest.mark.production_buckets
def test_async_warmup_compiles_every_decode_shape_once(llama_ckpt):
    """With one step per call every decode step is the fed-back call: warmup compiles it in
    place of the plain decode step, and traffic compiles nothing more."""
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=2, max_model_len=64, page_size=16, max_prefill_chunk=32)
    eng = llm.engine
    shapes = list(eng.runner.warmup_shapes(1, True))
    # the decode family fed back (N 1, 2), the general family (T 8, 16, 32): no host-fed decode step
    assert sorted({(s.decode, s.steps, s.tokens) for s in shapes}) == [(False, 0, 8), (False, 0, 16), (False, 0, 32),
                                                                        (True, 1, 1), (True, 1, 2)]
    assert len(shapes) == 2 * 5  # without and with top-k / top-p filtering
    eng.warmup()
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(1, 50, size=4)]
    llm.generate(prompts, jspec.SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)
    assert eng.stats()["num_chained_calls"] > 0


def test_serve_flags_and_bad_num_scheduler_steps(llama_ckpt):
    from jspec.serve.cli import build_parser, engine_kwargs

    kw = engine_kwargs(build_parser().parse_args(["--num-scheduler-steps", "4", "--no-async-scheduling"]))
    assert kw["num_scheduler_steps"] == 4 and kw["async_scheduling"] is False
    assert engine_kwargs(build_parser().parse_args([]))["async_scheduling"] is True
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1, got 0"):
        jspec.LLM(llama_ckpt[0], num_scheduler_steps=0, max_model_len=64)


def test_a_saturated_queue_still_chains(llama_ckpt):
    """Requests waiting behind max_num_seqs running ones cannot join before a row ends:
    decode calls chain meanwhile (offline generate at saturation), with the outputs of the
    synchronous engine."""
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(3, 30, size=6)]
    sp = jspec.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=2, max_model_len=64, page_size=16, enable_prefix_caching=False)
    outs = {}
    for mode in (False, True):
        llm = jspec.LLM(llama_ckpt[0], async_scheduling=mode, **kw)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[True] == outs[False]
    # three waves of two rows, 11 decode calls each: the first two waves chain too (a wave's
    # first call and the one after a row ends are dispatched fed by the host)
    assert llm.engine.stats()["num_chained_calls"] >= 2 * 8, llm.engine.stats()["num_chained_calls"]
