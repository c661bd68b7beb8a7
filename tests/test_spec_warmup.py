"""LLMEngine.warmup() with a drafter compiles every speculative shape up front, leaves the
caches untouched, and no request compiles anything afterwards (the server calls warmup
on every accelerator before it serves)."""

from __future__ import annotations

import pytest

import jspec
import spec_e2e_helpers as h

CASES = [("eagle3", 3, {"draft_sample_method": "probabilistic"}), ("peagle", 3, {}), ("dflash8_zlab", 7, {})]


@pytest.mark.parametrize("name,k,extra", CASES, ids=[c[0] for c in CASES])
def test_warmup_compiles_every_shape_once(name, k, extra):
    prompts = h.varied_prompts(5, 1, 40, seed=7)
    want = h.greedy_reference(prompts, 12)
    # seed=1: a fresh engine (the helpers cache engines by their arguments).
    llm = h.llm(name, k, spec_extra=extra, seed=1)
    eng = llm.engine
    shapes = eng.runner.warmup_shapes()
    b = eng.runner.buckets
    assert len(shapes) == len(b.batch) * len(b.pages) * (1 + len(b.prefill_q))
    assert sum(s.decode for s in shapes) == len(b.batch) * len(b.pages) and all(
        s.q == k + 1 for s in shapes if s.decode)
    eng.warmup()
    assert eng.runner.num_compilations == len(shapes)
    outs = llm.generate(prompts, jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert eng.spec_metrics.mean_acceptance_length > 1.3  # drafts were verified, not all rejected
    assert eng.runner.num_compilations == len(shapes)
