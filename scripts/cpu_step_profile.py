"""Where a batch-1 step of ``python -m jspec`` spends its time on XLA:CPU (issue 25).

Runs the family's target with or without a drafter on the CLI's four prompts (float32, 96
greedy tokens each, batch 1), compiles and warms up, then traces one ``generate`` with the
jax profiler and prints, per engine step:
  - wall time (the generate call over its steps),
  - time the host waited for the device program on XLA's thunk executor (a program XLA
    runs inline on the calling thread, as it does a plain decode step, adds nothing here),
  - the sum of the device program's op events, and the op kinds that took most of it.
The trace shows a dot that XLA hands to Eigen's thread pool only as its dispatch, so the
op sums understate such dots (docs/decisions.md, issue 25). The CPU step's figures in
docs/decisions.md come from this script and from alternating engines in one process.

    PYTHONPATH=. python3 scripts/cpu_step_profile.py                 # plain
    PYTHONPATH=. python3 scripts/cpu_step_profile.py --method dflash --k 1
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

import jax
from jax.profiler import ProfileData

import jspec
from jspec.__main__ import PROMPTS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="plain", help="plain, or a family drafter: dflash, eagle3, peagle")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the drafter's)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--top", type=int, default=12, help="op kinds to list")
    args = ap.parse_args(argv)
    spec = None
    if args.method != "plain":
        spec = {"method": args.method, **({"num_speculative_tokens": args.k} if args.k else {})}
    llm = jspec.LLM(None, speculative_config=spec, dtype="float32", max_model_len=512, max_num_seqs=1)
    sp = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for _ in range(2):  # compile every shape these requests meet, then once warm
        llm.generate(PROMPTS, sp, use_tqdm=False)
    before = llm.engine.stats()
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.get("num_drafts", 0) - before.get("num_drafts", 0) if spec else tokens
    steps = max(steps, 1)

    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    wait_ns, ops = 0, collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("ThunkExecutor::Execute (wait"):
                    wait_ns += e.duration_ns
                elif line.name.startswith("tf_XLA") and "Thunk" not in e.name and "Threadpool" not in e.name:
                    ops[re.sub(r"[.0-9]+$", "", e.name.replace("end: ", ""))] += e.duration_ns
    us = 1e-3 / steps
    print(f"{args.method}{f' K={llm.engine.K}' if spec else ''}: {tokens} tokens in {steps} steps "
          f"({tokens / steps:.2f} per step), {wall * 1e3 / steps:.2f} ms of wall per step")
    print(f"  waited for the device program: {wait_ns * us:.0f} us per step (inline programs: none)")
    print(f"  op events: {sum(ops.values()) * us:.0f} us per step; by kind:")
    for kind, ns in ops.most_common(args.top):
        print(f"    {ns * us:8.1f} us  {kind}")


if __name__ == "__main__":
    main()
