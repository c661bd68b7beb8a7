"""Issue 3: continuous batching, paging, prefix caching, seeds, compilations, bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import jspec
from tests.helpers.targets import hf_greedy, random_prompt

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tight_llm(llama_ckpt):
    # 40 pages x 16 = 640 token slots: far less than 8 running prompts of up to 300 tokens.
    return jspec.LLM(llama_ckpt[0], max_num_seqs=8, max_model_len=384, page_size=16, num_pages=40,
                     max_prefill_chunk=64)


def test_forty_prompts_tight_pool_batch_invariant_and_equal_to_transformers(tight_llm, llama_ckpt):
    rng = np.random.default_rng(0)
    lengths = [1, 2, 3, 5, 8, 13, 17, 31, 32, 33, 47, 64, 65, 100, 127, 128, 129, 150, 199, 200,
               201, 230, 255, 256, 257, 270, 280, 290, 299, 300, 4, 9, 16, 63, 99, 111, 222, 250, 260, 15]
    assert len(lengths) == 40 and max(lengths) == 300
    prompts = [random_prompt(rng, n) for n in lengths]
    n_new = [int(rng.integers(4, 20)) for _ in prompts]
    params = [jspec.SamplingParams(max_tokens=n, **GREEDY) for n in n_new]
    eng = tight_llm.engine
    outs = tight_llm.generate(prompts, params)
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert eng.scheduler.num_preemptions > 0 or eng.stats()["num_pages"] * 16 < sum(lengths)
    assert eng.num_free_pages == eng.num_pages  # nothing leaked
    hf = llama_ckpt[1]
    for i, (p, n, o) in enumerate(zip(prompts, n_new, outs)):
        assert len(o.token_ids) == n
        alone = tight_llm.generate([p], params[i])[0]
        assert o.token_ids == alone.token_ids, f"prompt {i} (len {len(p)}): batch != alone"
        if i % 4 == 0:  # transformers is the slow part; every 4th prompt covers all lengths
            assert o.token_ids == hf_greedy(hf, p, n), f"prompt {i} (len {len(p)}) != transformers"


def test_decode_growth_preempts_and_recomputes_exactly(llama_ckpt):
    """Sequences that outgrow a small pool are preempted (recompute) and still match."""
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=4, max_model_len=128, page_size=16, num_pages=12)
    rng = np.random.default_rng(6)
    prompts = [random_prompt(rng, n) for n in (20, 25, 30, 12)]
    sp = jspec.SamplingParams(max_tokens=90, **GREEDY)
    outs = llm.generate(prompts, sp)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_free_pages == llm.engine.num_pages
    for p, o in zip(prompts, outs):
        assert o.token_ids == llm.generate([p], sp)[0].token_ids


def snapshot_pages(eng, pages):
    kv = eng.runner.kv
    idx = np.asarray(pages, np.int32)
    return [(np.asarray(k[idx]).copy(), np.asarray(v[idx]).copy()) for k, v in zip(kv.k, kv.v)]


def test_prefix_caching_reuses_blocks_without_modifying_them(llama_ckpt):
    rng = np.random.default_rng(1)
    prefix = random_prompt(rng, 100)
    prompts = [prefix + random_prompt(rng, int(n)) for n in rng.integers(1, 40, size=6)]
    sp = jspec.SamplingParams(max_tokens=12, **GREEDY)
    outs = {}
    for caching in (False, True):
        llm = jspec.LLM(llama_ckpt[0], max_num_seqs=4, max_model_len=256, page_size=16, num_pages=96,
                        enable_prefix_caching=caching)
        eng = llm.engine
        first = llm.generate([prompts[0]], sp)[0]
        if caching:
            cached = sorted(eng.blocks.page_hash)  # pages registered by the first request
            assert len(cached) >= 100 // 16
            before = snapshot_pages(eng, cached)
        rest = llm.generate(prompts[1:], sp)
        outs[caching] = [first.token_ids] + [o.token_ids for o in rest]
        if caching:
            assert eng.blocks.hits >= 5 * (100 // 16), eng.stats()
            after = snapshot_pages(eng, cached)
            for (kb, vb), (ka, va) in zip(before, after):
                assert np.array_equal(kb, ka) and np.array_equal(vb, va)
        else:
            assert eng.blocks.hits == 0
    assert outs[True] == outs[False]


def test_pages_filled_by_the_last_step_are_cached(llama_ckpt):
    """A follow-up prompt (the first prompt and its output, as a chat's next turn) hits every
    full page of the first request, the page its final step filled included."""
    rng = np.random.default_rng(3)
    prompt = random_prompt(rng, 10)
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=2, max_model_len=128, page_size=16, num_pages=32)
    # 10 + 39 tokens: the final step computes position 47 and so fills the third page.
    first = llm.generate([prompt], jspec.SamplingParams(max_tokens=39, **GREEDY))[0]
    follow_up = prompt + first.token_ids
    hits = llm.engine.blocks.hits
    llm.generate([follow_up], jspec.SamplingParams(max_tokens=2, **GREEDY))
    assert llm.engine.blocks.hits - hits == (len(follow_up) - 1) // 16 == 3


def test_seeded_sampling_reproducible_across_runs_and_batches(llama_ckpt):
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, 20)
    others = [random_prompt(rng, int(n)) for n in (7, 40, 3)]
    sp = jspec.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=4, max_model_len=128, page_size=16)
    alone = llm.generate([prompt], sp)[0].token_ids
    again = llm.generate([prompt], sp)[0].token_ids
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [jspec.SamplingParams(temperature=1.0, max_tokens=9, seed=s) for s in (1, 2)] + [sp]
                         + [jspec.SamplingParams(temperature=0.0, max_tokens=5)])[2].token_ids
    fresh = jspec.LLM(llama_ckpt[0], max_num_seqs=2, max_model_len=128, page_size=16).generate([prompt], sp)[0].token_ids
    assert alone == again == mixed == fresh
    other_seed = llm.generate([prompt], jspec.SamplingParams(**{**sp.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone


@pytest.mark.production_buckets
def test_compilations_stay_fixed_as_requests_come_and_go(llama_ckpt):
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=2, max_model_len=64, page_size=16, max_prefill_chunk=32)
    eng = llm.engine
    shapes = list(eng.runner.warmup_shapes(1, eng.config.async_scheduling))
    eng.warmup()
    b = eng.runner.shapes
    assert (b.batch, b.tokens) == ((1, 2), (8, 16, 32))
    # decode N{1, 2} (fed back), general T{8, 16, 32}: without and with top-k / top-p filtering
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes) == 2 * (2 + 3)
    rng = np.random.default_rng(3)
    for _ in range(3):
        prompts = [random_prompt(rng, int(n)) for n in rng.integers(1, 50, size=5)]
        llm.generate(prompts, [jspec.SamplingParams(max_tokens=int(m), **GREEDY) for m in rng.integers(1, 10, 5)])
        assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], {}, "prompt is empty"),
        ([5] * 200, {}, "prompt has 200 tokens; max_model_len=128"),
        ([5, 384, 6], {}, r"prompt token 1 = 384 is not a token id in \[0, 384\)"),
        ([5, -1], {}, r"prompt token 1 = -1"),
        ("text", {}, "no tokenizer"),
    ],
)
def test_bad_prompt_is_rejected_and_others_unaffected(llama_ckpt, prompt, params, match):
    llm = _shared_llm(llama_ckpt)
    eng = llm.engine
    good = random_prompt(np.random.default_rng(4), 30)
    sp = jspec.SamplingParams(max_tokens=10, **GREEDY)
    expected = llm.generate([good], sp)[0].token_ids
    eng.add_request("good", good, sp)
    eng.step()
    eng.step()
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", prompt, jspec.SamplingParams(**params))
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt])  # validated up front: nothing queued
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    assert done.request_id == "good" and done.token_ids == expected
    assert eng.num_free_pages == eng.num_pages


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -3}, "top_k must be"),
        ({"seed": -1}, "seed must be"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jspec.SamplingParams(**kwargs)


_LLM = {}


def _shared_llm(llama_ckpt):
    if "llm" not in _LLM:
        _LLM["llm"] = jspec.LLM(llama_ckpt[0], max_num_seqs=4, max_model_len=128, page_size=16)
    return _LLM["llm"]


def test_generate_inside_running_event_loop(llama_ckpt):
    llm = _shared_llm(llama_ckpt)
    p = random_prompt(np.random.default_rng(5), 9)
    sp = jspec.SamplingParams(max_tokens=6, **GREEDY)
    expected = llm.generate([p], sp)[0].token_ids

    async def main():  # as in Jupyter / Colab, where a loop is already running
        return llm.generate([p], sp)[0].token_ids

    assert asyncio.run(main()) == expected


def test_string_prompts_with_tokenizer_and_stop_tokens():
    llm = jspec.LLM(None, max_num_seqs=2, max_model_len=128)
    out = llm.generate(["Hello"], jspec.SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.text is not None and out.prompt_token_ids == llm.engine.tokenizer.encode("Hello")
    first = out.token_ids[0]
    stopped = llm.generate(["Hello"], jspec.SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_multi_step_scheduling_matches_single_steps(llama_ckpt):
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, n) for n in (5, 30, 17)]
    greedy = jspec.SamplingParams(max_tokens=21, **GREEDY)
    sampled = jspec.SamplingParams(temperature=0.8, top_k=40, max_tokens=21, seed=11, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=128, page_size=16)
    single = jspec.LLM(llama_ckpt[0], num_scheduler_steps=1, **kw)
    multi = jspec.LLM(llama_ckpt[0], num_scheduler_steps=4, **kw)
    steps_run, run = [], multi.engine.runner.run
    multi.engine.runner.run = lambda inp, steps=0, prev=None: steps_run.append(steps) or run(inp, steps, prev)
    outs = {}
    for name, sp in (("greedy", greedy), ("sampled", sampled)):
        outs[name] = [o.token_ids for o in single.generate(prompts, sp)]
        assert outs[name] == [o.token_ids for o in multi.generate(prompts, sp)], name
    assert 4 in steps_run  # the multi-step path really ran
    # A stop token in the middle of a 4-step block ends the output exactly where one step would.
    first = outs["greedy"][0]
    cut = first.index(first[5]) + 1  # the first occurrence of the stop token ends the output
    stop = jspec.SamplingParams(max_tokens=21, temperature=0.0, stop_token_ids=[first[5]])
    assert single.generate(prompts[:1], stop)[0].token_ids == multi.generate(prompts[:1], stop)[0].token_ids == first[:cut]
    assert multi.engine.num_free_pages == multi.engine.num_pages
