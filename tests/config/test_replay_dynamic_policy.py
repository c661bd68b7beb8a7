"""scripts/replay_dynamic_policy.py on the measured step times it ships beside
(docs/bench): a useless drafter's replay runs plain but for probes, a poor one (first-draft
rate 0.28, tau 1.3's) needs fewer calls than tokens, a good one fewer still and wider."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import replay_dynamic_policy as rp  # noqa: E402

RUN = os.path.join(ROOT, "docs", "bench", "2026-11-29_throughput_dynamic_tau1.3_505ec27_h200.json")


def test_replays_by_acceptance():
    times, buckets = rp.step_times(RUN, "eagle3")
    assert buckets[-1] == 256
    assert (4, 128) in times and times[(4, 128)] > times[(1, 128)]  # warmup's estimate, scaled
    _, calls, widths = rp.replay(times, buckets, 32, 128, 0.0, 3, seed=0)
    assert calls >= 128 and widths.get(1, 0) >= 0.9 * calls, widths
    _, poor, _ = rp.replay(times, buckets, 32, 128, 0.28, 3, seed=0)
    assert poor < 0.9 * 128
    _, good, widths = rp.replay(times, buckets, 32, 128, 0.8, 3, seed=0)
    assert good < 0.5 * 128 and max(widths, key=widths.get) == 4, widths
