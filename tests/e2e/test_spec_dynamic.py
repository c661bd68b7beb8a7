"""Issue 58 must-show: dynamic speculation (jspec/engine/dynamic_spec.py) stays lossless and
stops a useless drafter.

- Every step's width and every row's draft count drawn at random (a seeded stand-in for the
  policy's choice, so every transition is exercised: plain steps without the drafter,
  narrower widths, rows verifying fewer drafts, chained calls behind each): greedy output
  equals plain greedy token for token (EAGLE3 with async scheduling, DFlash without, a draft
  model), and sampled output follows the target's distribution (chi-squared at the first
  verified positions, as tests/e2e/test_spec_distribution.py).
- A step of width 1 verifies nothing but still writes the drafter's cache: with the trained
  family, the drafts proposed at every position of a run at random widths equal those of a
  run at full width (a cache with holes where plain steps ran proposes other drafts: 85% equal
  for EAGLE3 before the drafter ran at width 1).
- The policy itself, with a draft model that never agrees with the target (it proposes one
  token the target's greedy run never emits): after a few measured steps its request stops
  drafting, a later request drafts only in its probes (one step in probe_every), and the
  output is still plain greedy's.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

import jspec
from jspec import family
from tests.e2e.test_spec_distribution import PROMPT, target_probs
from tests.helpers import spec_e2e as h

MAX_TOKENS = 24
PROMPTS = h.varied_prompts(6, 1, 40, seed=3)
DYNAMIC = {"dynamic": True}


def random_widths(eng, seed: int):
    """Replace the engine's choice by a seeded random one (any width, any drafts per row)."""
    rng = np.random.default_rng(seed)
    policy = eng.policy
    choose = policy.choose

    def pick(rows, N, fixed=False, mixed=False):
        q, _ = choose(rows, N, fixed, mixed)  # the policy's bookkeeping runs as usual
        q = q if fixed else int(rng.choice(policy.widths))
        return q, [int(rng.integers(0, min(q - 1, room, have) + 1)) for _, room, have in rows]

    policy.choose = pick
    return choose


@pytest.mark.parametrize("name,k,asyn,mixed", [("eagle3", 3, True, False), ("dflash8_zlab", 7, False, False),
                                               ("draft_llama", 3, True, False), ("eagle3", 3, True, True)])
def test_random_widths_are_lossless(name, k, asyn, mixed):
    """``mixed``: decode rows and prompt chunks share steps (the server's policy): a mixed
    step's rows verify the drafts drawn for them too."""
    want = h.greedy_reference(PROMPTS, MAX_TOKENS)
    mix = {"max_num_partial_prefills": 1} if mixed else {}
    llm = h.llm(name, k, spec_extra=DYNAMIC, async_scheduling=asyn, **mix)
    eng = llm.engine
    assert eng.policy.widths == (1, 2, 4) + ((8,) if k == 7 else ())
    choose = random_widths(eng, seed=k)
    try:
        before = eng.stats()
        outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        eng.policy.choose = choose
    d = h.stats_delta(before, eng.stats())
    for p, o, w in zip(PROMPTS, outs, want):
        assert o.token_ids == w, f"prompt of length {len(p)}: dynamic speculation's output differs"
    assert d["mean_acceptance_length"] > 1.3, d  # drafts were verified and accepted, not only plain steps
    if asyn:
        assert eng.stats()["num_chained_calls"] > 0
    assert bool(eng.policy.stats()["mixed_steps_by_width"]) == mixed  # the policy chose for mixed steps' rows


def _proposals(llm, prompts, sp, widths_seed: int | None):
    """(outputs, {(prompt index, sequence length): the drafts proposed there}) of one generate
    call, at random widths (``random_widths``) or at the full width."""
    eng = llm.engine
    seen, order = {}, {}
    advance = eng._advance

    def record(seq, toks, n, lp):
        out = advance(seq, toks, n, lp)
        if seq.draft_token_ids and seq.num_tokens < len(seq.prompt_token_ids) + sp.max_tokens:  # still running
            seen[(order.setdefault(seq.request_id, len(order)), seq.num_tokens)] = tuple(seq.draft_token_ids)
        return out

    eng._advance = record
    choose = random_widths(eng, widths_seed) if widths_seed is not None else None
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        del eng._advance
        if choose is not None:
            eng.policy.choose = choose
    return [o.token_ids for o in outs], seen


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_width_one_keeps_the_drafter_cache_whole(method):
    from jspec.train import tokenizer

    tok = tokenizer.load_tokenizer(family.TARGET)
    prompts = [tok.encode(inspect.getsource(m)[:400]).ids[:64] for m in (json, inspect, np.lib.npyio, pytest)]
    sp = jspec.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # one engine (no prefix cache: the second run computes what the first did)
    llm = jspec.LLM(speculative_config={"method": method, "num_speculative_tokens": 3, "dynamic": True},
                    dtype="float32", max_model_len=160, max_num_seqs=4, warmup=False, enable_prefix_caching=False)
    llm.engine.policy.enabled = False
    want, full = _proposals(llm, prompts, sp, None)  # the full width throughout
    llm.engine.policy.enabled = True
    before = llm.engine.stats()["decode_steps_by_width"]
    got, mixed = _proposals(llm, prompts, sp, 5)  # random widths, plain steps among them
    widths = {q: n - before.get(q, 0) for q, n in llm.engine.stats()["decode_steps_by_width"].items()}
    assert got == want
    assert widths.get(1, 0) >= 4, widths  # plain steps ran, each followed by proposals
    common = sorted(set(full) & set(mixed))
    assert len(common) >= 40
    equal = sum(full[k] == mixed[k] for k in common)
    assert equal >= 0.98 * len(common), [(k, full[k], mixed[k]) for k in common if full[k] != mixed[k]]


def test_random_widths_sample_the_target():
    eng = h.llm("eagle3", 3, spec_extra=DYNAMIC, async_scheduling=True).engine
    choose = random_widths(eng, seed=11)
    try:
        toks = h.sample_trials(eng, PROMPT, 10 * h.V, 3)
    finally:
        eng.policy.choose = choose
    for j in (1, 2):
        ctx, inverse = np.unique(toks[:, :j], axis=0, return_inverse=True)
        probs = target_probs(ctx)[inverse.reshape(-1)]
        counts = np.bincount(toks[:, j], minlength=h.V).astype(np.float64)
        p, df = h.chi2_pvalue(counts, probs.sum(0))
        p_wrong, _ = h.chi2_pvalue(counts, target_probs(ctx, temperature=0.7)[inverse.reshape(-1)].sum(0))
        assert p > 1e-3 and p_wrong < 1e-6, (j, p, df, p_wrong)


def test_a_useless_drafter_stops_drafting(tmp_path):
    # A draft model that always proposes token t, which the target's greedy run never emits
    # (K positions past the end included): no draft is ever accepted, on any machine. (Random
    # weights agree now and then, and a lucky hit moves the engine-wide rate across
    # min_first_acceptance: how long a request drafts then depended on the machine.)
    folder, _ = h.target()
    K = 3
    sp = jspec.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    longer = h.greedy_reference(PROMPTS[:1], 40 + K + 1)[0]
    want = longer[:40]
    t = min(set(range(h.V)) - set(longer))
    drafter = h.build_target(seed=13, num_layers=2, boost=0.0)
    with torch.no_grad():  # logits: 0 everywhere but t's, C_EMBED along F (which no layer writes)
        drafter.lm_head.weight.zero_()
        drafter.model.norm.weight[h.F] = 1.0
        drafter.lm_head.weight[t, h.F] = np.sign(h.C_EMBED)
    drafter.save_pretrained(tmp_path)
    for dynamic in (False, True):
        llm = jspec.LLM(folder, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                    "num_speculative_tokens": K, "dynamic": dynamic},
                        warmup=False, **h.ENGINE_KW)
        eng = llm.engine
        if dynamic:  # every step at the full width, as in a batch whose other rows' drafts pay: the
            # stop rule alone decides what this row verifies (on measured step times a lone row
            # may run plain instead, and then nothing is measured: CI's machine did, 2026-11-29)
            eng.policy._width = lambda rates, room, N, fixed, explore=True: K + 1
        for call in range(2):  # the second call's request starts from what the first measured
            before = eng.stats()
            assert llm.generate(PROMPTS[:1], sp)[0].token_ids == want
            a = eng.stats()
            steps, drafts = a["num_decode_steps"] - before["num_decode_steps"], \
                a["num_scheduled_drafts"] - before["num_scheduled_drafts"]
            assert steps >= 30 and a["num_accepted_tokens"] == before["num_accepted_tokens"]
            if not dynamic:  # every step verifies K drafts (fewer near max_model_len)
                assert drafts >= 2 * steps
            elif call == 1:  # the engine-wide first-draft rate, measured by the first call, is
                # below min_first_acceptance: the new request drafts only in its probes
                assert eng.policy.engine_rates()[0] < eng.policy.min_first_acceptance
                assert drafts <= K * (steps // eng.policy.probe_every + 1), (steps, drafts)
