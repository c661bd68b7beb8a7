"""``python -m jspec``: the main job on the embedded default model.

Builds (first time) and loads the tiny default checkpoint, generates for a few prompts,
and prints the outputs and engine counters. ``--model PATH`` runs any HF folder instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import jspec


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jspec", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded tiny model)")
    ap.add_argument("--speculative-config", default=None, help="JSON, e.g. '{\"method\": \"eagle3\", ...}'")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (a random model then repeats itself)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's dtype")
    ap.add_argument("prompts", nargs="*", default=["Hello, my name is", "The capital of France is", "def fib(n):"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jspec.engine").setLevel(logging.INFO)  # the backend and devices the engine runs on
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    t0 = time.perf_counter()
    llm = jspec.LLM(args.model, dtype=args.dtype, max_model_len=512, speculative_config=spec)
    t1 = time.perf_counter()
    sp = jspec.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    outs = llm.generate(args.prompts, sp)
    t2 = time.perf_counter()
    for o in outs:
        print(f"{o.prompt!r} -> {o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}]")
    n = sum(len(o.token_ids) for o in outs)
    print(f"model {llm.engine.model_name}: load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s ({n} tokens, incl. compilation)")
    print("stats:", json.dumps(llm.engine.stats()))


if __name__ == "__main__":
    main()
