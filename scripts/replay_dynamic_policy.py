"""Replay dynamic speculation's choices (jspec/engine/dynamic_spec.py) on a measured run's
step times, on the host alone: B requests of N tokens decoded at once, each draft accepted
with probability ``--alpha`` (the synthetic acceptance of a poor or good drafter), every
call's time the one ``bench_throughput.py --dynamic on`` measured for its width and batch
bucket. Prints the decode calls, their widths and the decode time against width 1's (the
drafter's engine never drafting) and, with --plain-ms, against a plain engine's step.

    # the tau 1.3 run of docs/benchmarks.md (first-draft rate ~0.28), batches 32 and 64
    python3 scripts/replay_dynamic_policy.py docs/bench/2026-11-29_throughput_dynamic_tau1.3_505ec27_h200.json \\
        --batches 32,64 --alpha 0.28 --plain-ms 5.9,7.5

What it leaves out: the host, the prefill, a call's time varying with context. What it is
for: a policy change's effect on the number and widths of calls, before a GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jspec.engine.buckets import pick, pow2_buckets  # noqa: E402
from jspec.engine.dynamic_spec import DynamicSpeculation, decode_widths  # noqa: E402


def step_times(path: str, method: str) -> tuple[dict[tuple[int, int], float], tuple[int, ...]]:
    """((width, batch bucket) -> seconds, the engine's batch buckets) of the last ``method``
    row: its measured times; a pair never measured, the policy's own estimate from warmup's
    time on empty rows (DynamicSpeculation._time, scaled as width 1's measured time)."""
    rows = [r for r in json.load(open(path))["rows"] if r["method"] == method and r.get("step_ms")]
    if not rows:
        raise SystemExit(f"{path}: no {method} row with step times (bench_throughput.py --dynamic on)")
    p = DynamicSpeculation(1, (1,), True)
    for key, ms in rows[-1]["step_ms"].items():
        kind, qn = key.split(" ")
        q, n = map(int, qn.split(","))
        if kind == "measured":
            p.record_time(q, n, ms / 1e3)
        else:
            p.warm[(q, n)] = ms / 1e3
    pairs = set(p.times) | set(p.warm)  # a pair never measured: warmup's time, scaled where width 1 was measured
    return {(q, n): p._time(q, n, 1) for q, n in pairs}, pow2_buckets(1, rows[-1]["max_num_seqs"])


def replay(times, buckets, B: int, tokens: int, alpha: float, K: int, seed: int):
    """(decode seconds, calls, calls by width) of one replay."""
    rng = np.random.default_rng(seed)
    p = DynamicSpeculation(K, decode_widths(K, True, None), True)
    for (q, n), t in times.items():
        p.record_time(q, n, t)
    left = {f"r{i}": tokens for i in range(B)}
    have = dict.fromkeys(left, 0)  # drafts each row holds (none after a width-1 call)
    seconds = calls = 0
    while left:
        rows = list(left)
        N = pick(buckets, len(rows))
        q, ks = p.choose([(r, K, have[r]) for r in rows], N)
        if (q, N) not in times:
            raise SystemExit(f"no measured time for width {q} at batch bucket {N}")
        seconds, calls = seconds + times[(q, N)], calls + 1
        verified = []
        for r, k in zip(rows, ks):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            if k:
                verified.append((r, k, a))
            left[r] -= 1 + a
            have[r] = K if q > 1 else 0
            if left[r] <= 0:
                del left[r]
                p.forget(r)
        p.record_acceptance(verified)
    return seconds, calls, dict(sorted(p.steps_by_width.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="bench_throughput.py's json, run with --dynamic on")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=0.28, help="each draft's acceptance probability")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--plain-ms", default="", help="a plain engine's ms a step at each batch (comma-separated)")
    args = ap.parse_args()
    times, buckets = step_times(args.json, args.method)
    batches = [int(b) for b in args.batches.split(",")]
    plain = [float(x) for x in args.plain_ms.split(",")] if args.plain_ms else [None] * len(batches)
    for B, plain_ms in zip(batches, plain):
        runs = [replay(times, buckets, B, args.tokens, args.alpha, args.k, s) for s in range(args.seeds)]
        secs = float(np.mean([r[0] for r in runs]))
        width1 = args.tokens * times[(1, pick(buckets, B))]
        vs = f"; a plain engine's {args.tokens} steps {args.tokens * plain_ms / 1e3:.3f} s -> " \
             f"{args.tokens * plain_ms / 1e3 / secs:.3f}x" if plain_ms else ""
        print(f"B={B}: {np.mean([r[1] for r in runs]):.1f} calls {runs[0][2]}, decode {secs:.3f} s; width 1 "
              f"throughout {width1:.3f} s -> {width1 / secs:.3f}x{vs}")


if __name__ == "__main__":
    main()
