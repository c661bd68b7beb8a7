"""Issue 5 must-show: synthetic acceptance end to end.

rejection_sample_method="synthetic" with synthetic_acceptance_length=2.6 and K=3 forces
the accept decisions at the minimum-variance schedule [1, 0.6, 0]: over >= 3,000 real
engine steps-times-requests (the full EAGLE3 drafter and target run every step), the
engine's measured mean acceptance length is 2.6 +- 0.05 and the per-position acceptance
rates are [1, 0.6, 0] +- 0.02 (binomial sd at 0.6 is ~0.009 here).
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers import spec_e2e as h

# 64 requests decoded together for ~48 steps: the batch shape never changes (2 compilations).
KW = dict(max_num_seqs=64, max_model_len=192, page_size=64, max_num_batched_tokens=512, num_pages=None)


def test_synthetic_acceptance_length_measured():
    llm = h.llm("eagle3", 3, spec_extra={"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.6},
                **KW)
    eng = llm.engine
    assert eng.runner.spec.synthetic_unconditional_rates == pytest.approx([1.0, 0.6, 0.0])
    rng = np.random.default_rng(5)
    sp = jspec.SamplingParams(temperature=0, max_tokens=180, ignore_eos=True)
    rids = [f"syn-{i}" for i in range(64)]
    for rid in rids:
        eng.add_request(rid, [int(t) for t in rng.integers(8, h.V, size=8)], sp)
    before = eng.stats()
    while eng.stats()["num_drafts"] - before["num_drafts"] < 3000:
        eng.step()
    for rid in rids:
        eng.abort_request(rid)
    d = h.stats_delta(before, eng.stats())
    assert d["num_drafts"] >= 3000 and d["num_draft_tokens"] == 3 * d["num_drafts"]
    rates = [a / d["num_drafts"] for a in d["accepted_per_position"]]
    print(f"synthetic 2.6, K=3: {d['num_drafts']} drafts, mean acceptance length "
          f"{d['mean_acceptance_length']:.4f}, per-position rates {np.round(rates, 4).tolist()}")
    assert abs(d["mean_acceptance_length"] - 2.6) < 0.05
    assert rates == pytest.approx([1.0, 0.6, 0.0], abs=0.02)
    assert eng.stats()["mean_acceptance_length"] == pytest.approx(d["mean_acceptance_length"])
