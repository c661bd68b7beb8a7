"""Issue 28 with a drafter: verification rows and prefill chunks in one step
(jspec/engine/spec_mixed.py).

One small mixing engine per drafter (EAGLE3 with probabilistic drafts, DFlash), every shape
compiled by warmup (verification and its chained form at B 1 / 2, the prefill chunk at B 1,
mixed [B, K + 1] + [1, 16]), serving requests that arrive at random steps in a pool tight
enough to preempt: greedy outputs equal the target's greedy decoding, seeded T=1 outputs
equal the request run alone, drafts are accepted, mixed steps ran, nothing compiles after
warmup and every page is free at the end. With structured outputs, warmup also compiles the
masked mixed step (both segments masked: jspec/engine/mixed.py ``masked_alike``).
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec.engine.mixed import mixed_shapes
from tests.helpers import spec_e2e as h
from tests.helpers.engine import drive, precompile_then_warmup

# Engines whose unmixed shapes other files compile too (one compilation per CI run, through
# the persistent cache): test_spec_warmup's EAGLE3, test_spec_lossless's DFlash.
CASES = [("eagle3", 3, {"draft_sample_method": "probabilistic"}), ("dflash4", 3, {})]


@pytest.mark.parametrize("name,k,extra", CASES, ids=[c[0] for c in CASES])
def test_random_arrivals_mix_and_match_greedy_and_alone(name, k, extra, monkeypatch):
    llm = h.llm(name, k, spec_extra=extra, max_num_partial_prefills=1)
    eng, r = llm.engine, llm.engine.runner
    emitted, run = [], r.execute_spec_mixed

    def recording(sched):  # tokens each decode row of a mixed step emitted
        res = run(sched)
        emitted.extend(res.num_emitted[: sched.num_decode].tolist())
        return res

    monkeypatch.setattr(r, "execute_spec_mixed", recording)
    shapes = eng.warmup_shapes()
    assert sorted((s.batch, s.q, s.prefill_rows, s.steps) for s in shapes if s.prefill_rows or not s.decode) == [
        (1, 16, 0, 0),
        (1, 16, 1, 0),
        (2, 16, 1, 0),
    ]  # prefill rows: at most max_num_partial_prefills
    assert len(shapes) == 7 and len(mixed_shapes(r.buckets)) == 2
    if name == "dflash4":  # compiled ahead on two threads, as on an accelerator (RunnerBase.precompile)
        ahead, in_warmup = precompile_then_warmup(eng)
        assert ahead >= len(shapes) and in_warmup == 0
    else:
        eng.warmup()
    n = r.num_compilations
    assert n == len(shapes)
    rng = np.random.default_rng(28)
    script, reqs = {}, {}
    prompts = h.varied_prompts(6, 3, 40, seed=28)
    prompts[5] = prompts[1][:30] + prompts[5][:6]  # a prefix-cache hit (the EAGLE drafter recomputes a page)
    for i, prompt in enumerate(prompts):
        sp = jspec.SamplingParams(
            max_tokens=int(rng.integers(8, 14)),
            ignore_eos=True,
            **(dict(temperature=0.0) if i % 3 else dict(temperature=1.0, seed=100 + i)),
        )
        script.setdefault(int(rng.integers(0, 12)), []).append(("add", f"r{i}", prompt, sp))
        reqs[f"r{i}"] = (prompt, sp)
    before, mixed, pre = eng.stats(), r.num_mixed_steps, eng.scheduler.num_preemptions
    done = drive(llm, script)
    d = h.stats_delta(before, eng.stats())
    assert r.num_mixed_steps - mixed >= 3
    assert eng.num_chained_calls > before["num_chained_calls"]  # decode-only steps still chain
    assert r.num_compilations == n
    assert eng.num_free_pages == eng.num_pages
    assert eng.scheduler.num_preemptions > pre  # the pool of 6 pages is tight
    assert d["mean_acceptance_length"] > 1.3, d
    assert max(emitted) > 1  # drafts accepted in the decode segment of mixed steps
    assert eng.stats()["prefix_cache_hits"] > before["prefix_cache_hits"]
    for rid, (prompt, sp) in reqs.items():
        toks, reason = done[rid]
        assert reason == "length" and len(toks) == min(sp.max_tokens, eng.max_model_len - len(prompt)), rid
        if sp.temperature == 0.0:
            assert toks == h.greedy_reference([prompt], sp.max_tokens)[0][: len(toks)], rid
        else:
            assert toks == llm.generate([prompt], sp)[0].token_ids, rid
    assert r.num_compilations == n


def test_structured_warmup_compiles_the_masked_mixed_step(monkeypatch):
    """warmup(structured=True) also compiles the masked mixed steps, and a mixed step whose
    decode rows have grammar masks (the prefill rows none: mixed.masked_alike fills theirs)
    runs that variant. The tiny target has no tokenizer, so the rows' masks come from a
    stand-in grammar that allows every token (real grammars: tests/e2e/test_structured_outputs.py
    and, for the plain mixed step, tests/engine/test_structured.py): the outputs stay greedy."""
    from jspec.engine import runner_base

    llm = h.llm(*CASES[0][:2], spec_extra=CASES[0][2], max_num_partial_prefills=1)
    eng, r = llm.engine, llm.engine.runner
    eng.warmup()  # the unmasked shapes (compiled already when the test above ran)
    mixed = mixed_shapes(r.buckets)
    monkeypatch.setattr(r, "warmup_shapes", lambda *a: mixed)  # the other masked shapes: tested elsewhere
    n = r.num_compilations
    r.warmup(1, True, shapes=mixed, structured=True)
    assert r.num_compilations == n + len(mixed)  # the masked variants only
    build, build_mixed, masked, inside = runner_base.build_bitmask, r.build_spec_mixed_input, [], []

    def allow_all_for_mixed_decode_rows(rows, B, Q, V, chained=False):
        if not inside or Q == 1:  # other steps (their masked shapes: tested elsewhere), prefill rows
            return build(rows, B, Q, V, chained)
        masked.append(B)
        return r.allow_all(B, Q)

    def mixed_input(sched):
        inside.append(sched)
        try:
            return build_mixed(sched)
        finally:
            inside.pop()

    monkeypatch.setattr(runner_base, "build_bitmask", allow_all_for_mixed_decode_rows)
    monkeypatch.setattr(r, "build_spec_mixed_input", mixed_input)
    compiled, run = [], r.run_spec_mixed

    def counting(inp):
        k = r.num_compilations
        out = run(inp)
        compiled.append((r.num_compilations - k, inp.prefill.base.grammar_mask is not None))
        return out

    monkeypatch.setattr(r, "run_spec_mixed", counting)
    prompts = sorted(h.varied_prompts(2, 4, 40, seed=5), key=len)  # b: 40 tokens, 3 chunks beside a
    sp = {rid: jspec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for rid, n in (("a", 24), ("b", 8))}
    done = drive(llm, {0: [("add", "a", prompts[0], sp["a"])], 1: [("add", "b", prompts[1], sp["b"])]})
    assert masked and len(compiled) >= 2 and compiled == [(0, True)] * len(compiled), compiled
    for rid, p in zip("ab", prompts):
        assert done[rid][0] == h.greedy_reference([p], sp[rid].max_tokens)[0], rid
