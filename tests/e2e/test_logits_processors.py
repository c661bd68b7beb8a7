"""Issue 26: the logits processors (penalties, logit_bias, allowed_token_ids, bad_words,
min_tokens, min_p) act as vLLM's, plain and under verification with every drafter.

Greedy: the outputs equal a reference loop that applies the same processors (written out
in numpy, tests/helpers/sampling.py processed) to transformers' logits, plain and with EAGLE3,
PEagle and DFlash, for a batch mixing requests with and without each processor. Under
speculation, position j of the verified window counts the drafts before it, so a wrong
count would change the output whenever a draft is accepted (asserted to happen).
min_p (sampled rows): every sampled token keeps p >= min_p * max p under the reference
distribution, while the same seeds without min_p produce tokens below it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jspec
from tests.helpers import sampling as sh
from tests.helpers import spec_e2e as h

PROMPTS = h.varied_prompts(3, 2, 20, seed=5)
MAX = 12
COMBOS = {
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "bias_allowed": dict(logit_bias={h.X: -2.5, 20: 3.0}, allowed_token_ids=list(range(4, 48))),
    "bad_words": dict(bad_words=["w7 w7", "w13", "w20 w21 w22"]),
    "min_tokens": dict(min_tokens=5, logit_bias={sh.EOS: 9.0}, ignore_eos=False),
    "mixed": dict(repetition_penalty=0.8, bad_words=["w7 w7 w7"], logit_bias={9: 1.5}, min_tokens=3,
                  stop_token_ids=[h.X], ignore_eos=False, frequency_penalty=-0.3),
}


def params(combo: str) -> jspec.SamplingParams:
    return jspec.SamplingParams(**{"temperature": 0, "max_tokens": MAX, "ignore_eos": True, **COMBOS[combo]})


def requests():
    """Every (prompt, combo), plus plain greedy rows in the same batches (no processors)."""
    reqs = [(p, c) for c in COMBOS for p in PROMPTS]
    return reqs + [(p, None) for p in PROMPTS]


_REF: dict = {}


def reference(prompt, combo):
    key = (tuple(prompt), combo)
    if key not in _REF:
        sp = params(combo) if combo else jspec.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
        _REF[key] = sh.reference_greedy(prompt, sp)
    return _REF[key]


def test_reference_processors_change_the_output():
    """Each processor really acts on these prompts (else the comparison below is vacuous)."""
    for combo in COMBOS:
        assert any(reference(p, combo) != reference(p, None) for p in PROMPTS), combo
    # The multi-token bad word "w7 w7" is what ends the target's runs of 7 (the planted token).
    plain = [reference(p, None) for p in PROMPTS]
    assert any(a == b == h.X for o in plain for a, b in zip(o, o[1:]))
    for p in PROMPTS:
        o = reference(p, "bad_words")
        assert not any(a == b == h.X for a, b in zip(o, o[1:])) and 13 not in o


@pytest.mark.parametrize("name,k", sh.ENGINES, ids=[str(n) for n, _ in sh.ENGINES])
def test_greedy_with_processors_equals_reference(name, k):
    llm = sh.engine(name, k)
    eng = llm.engine
    reqs = requests()
    before = eng.stats()
    sps = [params(c) if c else jspec.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True) for _, c in reqs]
    outs = llm.generate([p for p, _ in reqs], sps)
    for (p, c), o in zip(reqs, outs):
        assert o.token_ids == reference(p, c), f"{name}: {c} on a prompt of length {len(p)}"
    stop = [o for (_, c), o in zip(reqs, outs) if c == "min_tokens"]
    assert all(len(o.token_ids) == 6 and o.token_ids[-1] == sh.EOS and o.finish_reason == "stop" for o in stop)
    if name is not None:  # drafts were accepted, so positions inside a draft were processed
        d = h.stats_delta(before, eng.stats())
        assert d["mean_acceptance_length"] > 1.2, d
    assert eng.num_free_pages == eng.num_pages


def _min_p_violations(outs, prompts, min_p: float, temperature: float) -> int:
    bad = 0
    for p, o in zip(prompts, outs):
        logits = sh.hf_logits(p + o.token_ids)[len(p) - 1 : -1]
        for t, row in zip(o.token_ids, logits):
            z = row.astype(np.float64) / temperature
            prob = np.exp(z - z.max())
            bad += prob[t] < min_p * 0.999  # max prob is 1 after the shift
    return bad


@pytest.mark.parametrize("name,k", [(None, None), ("eagle3", 3)], ids=["plain", "eagle3"])
def test_min_p_keeps_only_tokens_near_the_top(name, k):
    llm = sh.engine(name, k)
    prompts = PROMPTS * 2
    seeds = range(len(prompts))
    kw = dict(temperature=1.5, max_tokens=16, ignore_eos=True)
    with_min_p = llm.generate(prompts, [jspec.SamplingParams(seed=s, min_p=0.3, **kw) for s in seeds])
    without = llm.generate(prompts, [jspec.SamplingParams(seed=s, **kw) for s in seeds])
    assert _min_p_violations(with_min_p, prompts, 0.3, 1.5) == 0
    assert _min_p_violations(without, prompts, 0.3, 1.5) > 0  # the check can fail


@pytest.mark.parametrize("name,k", [(None, None), ("eagle3", 3), ("dflash4", 3)], ids=["plain", "eagle3", "dflash4"])
def test_chained_steps_see_the_tokens_of_the_step_before(name, k):
    """With async scheduling a step is dispatched before the previous one is read: the
    history the host sends lacks that step's tokens, which the device appends
    (flat_runner._decode_loop, spec_runner.continue_from). Two requests alone chain."""
    llm = sh.engine(name, k)
    eng = llm.engine
    reqs = [(PROMPTS[0], "penalties"), (PROMPTS[1], "bad_words")]
    sps = [dataclasses.replace(params(c), max_tokens=24) for _, c in reqs]
    before = eng.num_chained_calls
    outs = llm.generate([p for p, _ in reqs], sps)
    assert eng.num_chained_calls - before >= 3
    for (p, _), sp, o in zip(reqs, sps, outs):
        assert o.token_ids == sh.reference_greedy(p, sp)


def test_multi_step_decode_updates_the_history_between_its_steps():
    """num_scheduler_steps = 4: four decode steps per call, each sampled token appended to
    the history on the device before the next step's processors."""
    llm = sh.engine(None, None, num_scheduler_steps=4)
    reqs = [(PROMPTS[0], "penalties"), (PROMPTS[2], "mixed")]
    sps = [dataclasses.replace(params(c), max_tokens=24) for _, c in reqs]
    r = llm.engine.runner
    steps_run, run = [], r.run
    r.run = lambda inp, steps=0, prev=None: steps_run.append(steps) or run(inp, steps, prev)
    outs = llm.generate([p for p, _ in reqs], sps)
    assert 4 in steps_run  # the multi-step path ran
    for (p, _), sp, o in zip(reqs, sps, outs):
        assert o.token_ids == sh.reference_greedy(p, sp)


def test_processors_compile_once_per_shape():
    """Requests with other processors and values reuse the compiled steps: everything a
    row asks for is traced data (token lists padded to buckets: here the smallest, 64
    entries and 4 bad words of up to 4 tokens)."""
    llm = sh.engine(None, None)
    eng = llm.engine
    first = [params(c) for c in ("penalties", "bad_words")]
    llm.generate(PROMPTS[:2], first)
    n = eng.runner.num_compilations
    # Same lengths as before (a batch of one would be another shape, with or without processors).
    other = [jspec.SamplingParams(temperature=0.5, seed=1, min_p=0.1, max_tokens=MAX, logit_bias={3: 1.0, 4: -1.0},
                                  allowed_token_ids=list(range(5, 60)), logprobs=2, ignore_eos=True),
             jspec.SamplingParams(temperature=0, repetition_penalty=2.0, bad_words=["w9 w10 w11 w12"], max_tokens=MAX,
                                  min_tokens=2, ignore_eos=True)]
    llm.generate(PROMPTS[1:3], other)
    assert eng.runner.num_compilations == n
