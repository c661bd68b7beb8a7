"""Issue 26: ``logprobs`` and ``prompt_logprobs`` against transformers (float32, relative
error < 1e-4), in vLLM's shape (per token a dict id -> Logprob(logprob, rank,
decoded_token): the token itself plus the top N), the same with speculation on and off
(every drafter: they come from the verification logits at the emitting position), raw
and processed (``logprobs_mode``)."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers import sampling as sh
from tests.helpers import spec_e2e as h

PROMPTS = h.varied_prompts(3, 3, 30, seed=11)
N = 4
RTOL, ATOL = 1e-4, 1e-6  # relative error < 1e-4 (the absolute floor only matters for logprobs ~ 0)


def check_against_hf(prompt, out, *, n_prompt_lp=None):
    """The output's logprobs (and prompt logprobs) equal log_softmax of transformers' logits."""
    ids = prompt + out.token_ids
    lp = sh.log_softmax(sh.hf_logits(ids))  # [len(ids), V]; row i predicts token i + 1
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(out.token_ids)
    total = 0.0
    for i, (t, d) in enumerate(zip(out.token_ids, comp.logprobs)):
        row = lp[len(prompt) - 1 + i]
        top = np.argsort(-row, kind="stable")[:N]
        assert set(d) == {t} | set(top.tolist()), (i, sorted(d), t, top)
        for tid, v in d.items():
            np.testing.assert_allclose(v.logprob, row[tid], rtol=RTOL, atol=ATOL)
            assert v.decoded_token == f"w{tid}"
        assert [d[int(x)].rank for x in top] == [1, 2, 3, 4]
        if t not in top:
            assert d[t].rank == int((row >= row[t]).sum())
        total += d[t].logprob
    np.testing.assert_allclose(comp.cumulative_logprob, total, rtol=1e-6)
    if n_prompt_lp is not None:
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            row, d = lp[pos - 1], plp[pos]
            top = np.argsort(-row, kind="stable")[:n_prompt_lp]
            assert set(d) == {prompt[pos]} | set(top.tolist())
            for tid, v in d.items():
                np.testing.assert_allclose(v.logprob, row[tid], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,k", sh.ENGINES, ids=[str(n) for n, _ in sh.ENGINES])
def test_logprobs_match_transformers_plain_and_speculative(name, k):
    llm = sh.engine(name, k)
    greedy = jspec.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=N, prompt_logprobs=2)
    sampled = jspec.SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, logprobs=N,
                                   repetition_penalty=1.2)
    before = llm.engine.stats()
    outs = llm.generate(PROMPTS + PROMPTS, [greedy] * len(PROMPTS) + [sampled] * len(PROMPTS))
    for p, o in zip(PROMPTS, outs[: len(PROMPTS)]):
        check_against_hf(p, o, n_prompt_lp=2)
    for p, o in zip(PROMPTS, outs[len(PROMPTS):]):
        check_against_hf(p, o)  # raw logprobs: before the penalty
        assert o.prompt_logprobs is None
    if name is not None:
        assert h.stats_delta(before, llm.engine.stats())["mean_acceptance_length"] > 1.2
        plain = sh.engine(None, None).generate(PROMPTS, greedy)
        for a, b in zip(plain, outs):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert da.keys() == db.keys()
                np.testing.assert_allclose([v.logprob for v in da.values()], [db[t].logprob for t in da],
                                           rtol=RTOL, atol=ATOL)


def test_processed_logprobs_are_the_sampling_distribution():
    """logprobs_mode="processed_logprobs": log-softmax of what the sampler draws from
    (processors, then temperature and top-k), checked against the numpy reference."""
    llm = sh.engine(None, None, logprobs_mode="processed_logprobs")
    sp = jspec.SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=8, ignore_eos=True, logprobs=3,
                              presence_penalty=0.5, logit_bias={9: 2.0})
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp)):
        logits = sh.hf_logits(p + o.token_ids)
        for i, (t, d) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)):
            x = sh.processed(logits[len(p) - 1 + i], p, o.token_ids[:i], sp).astype(np.float64) / 0.7
            x[x < np.sort(x)[-5]] = -np.inf  # top-k 5
            row = sh.log_softmax(x)
            assert np.isfinite(row[t])  # the sampled token is inside the top 5
            for tid, v in d.items():
                np.testing.assert_allclose(v.logprob, row[tid], rtol=RTOL, atol=ATOL)
            assert sum(np.isfinite(row)) == 5 and len(d) <= 4


def test_prompt_logprobs_skip_the_prefix_cache():
    """Every prompt position is computed for prompt_logprobs (cached pages would have none)."""
    llm = sh.engine(None, None)
    prompt = h.varied_prompts(1, 40, 40, seed=3)[0]
    sp = jspec.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm.generate([prompt], jspec.SamplingParams(temperature=0, max_tokens=2))  # fills the cache
    o = llm.generate([prompt], sp)[0]
    lp = sh.log_softmax(sh.hf_logits(prompt))
    for pos in range(1, len(prompt)):
        np.testing.assert_allclose(o.prompt_logprobs[pos][prompt[pos]].logprob, lp[pos - 1, prompt[pos]],
                                   rtol=RTOL, atol=ATOL)
