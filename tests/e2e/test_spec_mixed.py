"""Issue 28 with a drafter: verification rows and prefill chunks in one flat step
(jspec/engine/flat_runner.py, flat_spec.py).

One small mixing engine per drafter (EAGLE3 with probabilistic drafts, DFlash), every shape
compiled by warmup (verification and its chained form at N 1 / 2, the general steps),
serving requests that arrive at random steps in a pool tight enough to preempt: greedy
outputs equal the target's greedy decoding, seeded T=1 outputs equal the request run alone,
drafts are accepted, mixed steps ran, nothing compiles after warmup and every page is free
at the end. With structured outputs, warmup also compiles the masked steps, and a mixed
step whose decode rows have grammar masks runs that variant.
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers import spec_e2e as h
from tests.helpers.engine import drive, precompile_then_warmup

pytestmark = pytest.mark.production_buckets  # about the real shape buckets (tests/conftest.py)

# Engines whose unmixed shapes other files compile too (one compilation per CI run, through
# the persistent cache): test_spec_warmup's EAGLE3, test_spec_lossless's DFlash.
CASES = [("eagle3", 3, {"draft_sample_method": "probabilistic"}), ("dflash4", 3, {})]


@pytest.mark.parametrize("name,k,extra", CASES, ids=[c[0] for c in CASES])
def test_random_arrivals_mix_and_match_greedy_and_alone(name, k, extra, monkeypatch):
    llm = h.llm(name, k, spec_extra=extra, max_num_partial_prefills=1)
    eng, r = llm.engine, llm.engine.runner
    emitted, apply = [], eng._apply

    def recording(sched, res, live=None):  # tokens each decode row of a mixed step emitted
        if sched.kind == "mixed":
            emitted.extend(res.num_emitted[: sched.num_decode].tolist())
        return apply(sched, res, live)

    monkeypatch.setattr(eng, "_apply", recording)
    shapes = eng.warmup_shapes()
    # verification at N 1 / 2 (chained or not); general steps up to 2 rows of K + 1 and a chunk;
    # each without and with top-k / top-p filtering
    assert sorted({(s.tokens, s.seqs, s.steps) for s in shapes if s.decode}) == [(4, 1, 1), (8, 2, 1)]
    assert sorted({s.tokens for s in shapes if not s.decode}) == list(r.shapes.tokens)
    assert len(shapes) == 2 * (2 + len(r.shapes.tokens))
    assert r.shapes.tokens[-1] == 2 * (k + 1) + eng.config.max_prefill_chunk
    if name == "dflash4":  # compiled ahead on two threads, as on an accelerator (jspec/engine/warmup.py, prepare)
        ahead, in_warmup = precompile_then_warmup(eng)
        assert ahead >= len(shapes) and in_warmup == 0
    else:
        eng.warmup()
    n = r.num_compilations
    assert n == len(shapes)
    rng = np.random.default_rng(28)
    script, reqs = {}, {}
    prompts = h.varied_prompts(6, 3, 40, seed=28)
    # r5 shares r4's first 34 tokens (two full pages): a prefix-cache hit even after the EAGLE
    # drafter's recomputed last page, whether r4's pages are still held or only cached
    assert len(prompts[4]) == 40
    prompts[5] = prompts[4][:34] + prompts[5][:6]
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


def test_structured_warmup_compiles_the_masked_steps(monkeypatch):
    """run_warmup(structured=True) also compiles the masked steps, and a mixed step whose decode
    rows have grammar masks (the prefill rows allow every token) runs that variant. The tiny
    target has no tokenizer, so the rows' masks come from a stand-in grammar that allows every
    token (real grammars: tests/e2e/test_structured_outputs.py, tests/engine/test_structured.py):
    the outputs stay greedy."""
    from jspec.engine import flat_input
    from jspec.engine.sampling_step import allow_all
    from jspec.engine.warmup import run_warmup

    llm = h.llm(*CASES[0][:2], spec_extra=CASES[0][2], max_num_partial_prefills=1)
    eng, r = llm.engine, llm.engine.runner
    eng.warmup()  # the unmasked shapes (compiled already when the test above ran)
    n = r.num_compilations
    run_warmup(r, 1, True, shapes=[], structured=True)
    shapes = eng.warmup_shapes()
    chained = sum(s.steps == 1 for s in shapes)
    # masked steps; a chained one's split forward (one either way of filtering) and tail
    assert r.num_compilations == n + len(shapes) + chained // 2 + chained
    build, masked = flat_input.build_bitmask, []

    def allow_all_for_decode_rows(rows, B, Q, V, chained=False):
        if not any(r_.seq.draft_token_ids for r_ in rows):  # steps without decode rows: no grammar
            return build(rows, B, Q, V, chained)
        masked.append(B)
        return allow_all(B, Q, V)

    monkeypatch.setattr(flat_input, "build_bitmask", allow_all_for_decode_rows)
    monkeypatch.setattr(eng, "_chain", lambda f: None)  # masked steps are read before the next (no split here)
    compiled, run = [], r.run

    def counting(inp, steps=0, prev=None):
        k = r.num_compilations
        out = run(inp, steps, prev)
        compiled.append(r.num_compilations - k)
        return out

    monkeypatch.setattr(r, "run", counting)
    prompts = sorted(h.varied_prompts(2, 4, 40, seed=5), key=len)  # b: 40 tokens, 3 chunks beside a
    sp = {rid: jspec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for rid, n in (("a", 24), ("b", 8))}
    done = drive(llm, {0: [("add", "a", prompts[0], sp["a"])], 1: [("add", "b", prompts[1], sp["b"])]})
    assert masked and len(compiled) >= 2 and not any(compiled), compiled
    assert r.num_mixed_steps > 0
    for rid, p in zip("ab", prompts):
        assert done[rid][0] == h.greedy_reference([p], sp[rid].max_tokens)[0], rid
