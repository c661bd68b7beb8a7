"""Speculative variants on the family, engines alternating in one process (issue 25's CPU figure).

``python -m jspec`` times one drafter against plain decoding; on a shared 2-core machine the
load moves between processes by more than the differences between drafters or K (benchmarks:
0.81-1.18x for one code). This script builds the plain engine and one engine per variant
(a DFlash folder, or any family method, at a K), runs the CLI's four prompts once each to
compile, then times every engine in turn over ``--rounds`` rounds (order reversed every
round; the CLI's ``_take_turns``) and prints each variant's median speedup over plain, per round, and its acceptance.

    PYTHONPATH=. python3 scripts/family_ab.py dflash:7 dflash:4 eagle3:3
    PYTHONPATH=. python3 scripts/family_ab.py dflash:7@/path/to/other/dflash --rounds 7
"""

from __future__ import annotations

import argparse
from statistics import median

import jspec
from jspec.__main__ import PROMPTS, _take_turns
from jspec.engine.sequence import spec_stats_delta


def parse_variant(v: str) -> dict:
    """"METHOD:K[@FOLDER]" -> a speculative_config (the family's drafter without a folder)."""
    head, _, folder = v.partition("@")
    method, _, k = head.partition(":")
    return {"method": method, **({"num_speculative_tokens": int(k)} if k else {}), **({"model": folder} if folder else {})}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="METHOD:K[@FOLDER], e.g. dflash:4 or dflash:7@runs/ft/dflash")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    kw = dict(dtype="float32", max_model_len=512, max_num_seqs=1)  # the CLI's engines
    sp = jspec.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = [jspec.LLM(None, **kw)] + [jspec.LLM(None, speculative_config=parse_variant(v), **kw)
                                      for v in args.variants]
    res = _take_turns(llms, PROMPTS, sp, args.rounds)  # the CLI's turns: compiled first, order reversed each round
    times = [t for _, t, _ in res]
    print(f"plain: median {median(times[0]):.3f} s a round")
    for i, v in enumerate(args.variants, 1):
        d = spec_stats_delta(res[i][2], llms[i].engine.stats())
        length = 1 + d["num_accepted_tokens"] / max(d["num_drafts"], 1)
        rounds = " ".join(f"{p / s:.2f}" for p, s in zip(times[0], times[i]))
        print(f"{v}: {median(times[0]) / median(times[i]):.2f}x (rounds {rounds}), acceptance length {length:.2f}")


if __name__ == "__main__":
    main()
