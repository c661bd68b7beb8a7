"""``python -m jspec``: the main job, speculative decoding on the embedded model family.

Loads jspec's own model family (jspec.family: a ~10M Llama trained on the Python standard
library, and its drafters), writes Python code from a few prompts with plain decoding and
then with a drafter (DFlash unless ``--method``), and prints the text, the mean acceptance
length, the acceptance rate per draft position and the speedup over plain decoding, both
timed in this run after compilation: the two engines take turns (``--rounds``, the median
of each), so a change in the machine's load between them does not decide the ratio.
Greedy by default, so the two outputs must be equal. ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from statistics import median

import jspec
from jspec import family
from jspec.engine.kv_memory import claim_device_memory
from jspec.engine.sequence import spec_stats_delta

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\n\ndef walk_files(root, suffix='.py'):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


def _timed(llm, prompts, sp):
    """(outputs, seconds, engine counters before the call)."""
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return outs, time.perf_counter() - t0, before


def _take_turns(llms, prompts, sp, rounds: int):
    """Per engine: (outputs, seconds of each timed round, counters before its first round).
    One untimed call each first compiles every shape these requests meet; then the engines
    alternate, their order reversed every round, so that a shift in the load of a shared
    machine falls on both."""
    for llm in llms:
        llm.generate(prompts, sp)  # with a progress bar: on a CPU the first call compiles for tens of seconds
    res = [None] * len(llms)
    for r in range(rounds):
        for i in (range(len(llms)) if r % 2 == 0 else reversed(range(len(llms)))):
            outs, t, before = _timed(llms[i], prompts, sp)
            res[i] = (outs, res[i][1] + [t], res[i][2]) if res[i] else (outs, [t], before)
    return res


DESCRIPTION = """Speculative decoding on jspec's embedded model family (no download): Python code
from a few prompts, decoded plainly and with a drafter (DFlash unless --method), with the
mean acceptance length, the acceptance per draft position and the speedup over plain
decoding, both timed in this run after compilation."""

EXAMPLES = """examples:
  python -m jspec                      # DFlash
  python -m jspec --method eagle3      # or peagle, or ngram (vLLM's prompt lookup: no drafter)
  python -m jspec --no-spec            # plain decoding only
  python -m jspec --model PATH --speculative-config '{"method": "eagle3", "model": "DRAFTER"}'"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, unless the help says its own; the examples kept as written."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jspec", description=DESCRIPTION, epilog=EXAMPLES,
                                 formatter_class=_Formatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the family's target)")
    ap.add_argument("--method", default=family.DEFAULT_METHOD, choices=family.METHODS + ("ngram",),
                    help="the family drafter to speculate with, or ngram (vLLM's prompt lookup: K=3, n-grams of "
                         "1 to 3 tokens)")
    ap.add_argument("--speculative-config", default=None, help="JSON, vLLM's keys; overrides --method")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding only")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, so speculative and plain outputs must be equal")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed of every request")
    ap.add_argument("--dtype", default="float32",
                    help="float32 by default: the family is small, and in bfloat16 the K+1-row verification and "
                         "the one-row decode round differently, so greedy outputs part at near-ties (1 of 4 equal "
                         "on the H200); 'auto' takes the checkpoint's dtype")
    ap.add_argument("--max-num-seqs", type=int, default=1,
                    help="requests decoded together (1: one stream at a time, the latency case speculation is for)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed calls per engine, taken in turns; tok/s is the median over them")
    ap.add_argument("prompts", nargs="*", default=None,
                    help="prompts to continue (default: the beginnings of four Python functions and classes)")
    args = ap.parse_args(argv)
    args.prompts = args.prompts or PROMPTS
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the backend and devices the engine runs on, and each step shape as it compiles
    logging.getLogger("jspec.engine").setLevel(logging.INFO)
    try:
        spec = json.loads(args.speculative_config) if args.speculative_config else {"method": args.method}
    except ValueError as e:
        ap.error(f"--speculative-config is not valid JSON: {e}")
    try:
        run(args, spec)
    except (ValueError, OSError) as e:  # a user's mistake (a path, a config key, a value): one line, no traceback
        ap.exit(2, f"{ap.prog}: error: {e}\n")


def run(args, spec: dict):
    if spec == {"method": "ngram"}:  # vLLM requires K; its default n-grams (5 tokens) rarely recur in short code
        spec.update(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    kw = dict(dtype=args.dtype, max_model_len=512, max_num_seqs=args.max_num_seqs)
    sp = jspec.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    n_tokens = lambda outs: sum(len(o.token_ids) for o in outs)  # noqa: E731
    rounds = max(args.rounds, 1)

    # Both engines stay loaded to take turns: on an accelerator the process's memory pool is
    # vLLM's default share of the device, and each engine has half of it.
    claim_device_memory(0.9)
    plain_llm = jspec.LLM(args.model, gpu_memory_utilization=0.45, **kw)
    if args.no_spec:
        ((plain, t_plain, _),) = _take_turns([plain_llm], args.prompts, sp, rounds)
        print(f"model {plain_llm.engine.model_name}: plain decoding {n_tokens(plain) / median(t_plain):.1f} tok/s")
        for o in plain:
            print(f"\n--- {o.prompt!r}\n{o.text}")
        return
    llm = jspec.LLM(args.model, speculative_config=spec, gpu_memory_utilization=0.45, **kw)
    (plain, t_plain, _), (outs, t_spec, before) = _take_turns([plain_llm, llm], args.prompts, sp, rounds)
    print(f"model {plain_llm.engine.model_name}: plain decoding {n_tokens(plain) / median(t_plain):.1f} tok/s")
    d = spec_stats_delta(before, llm.engine.stats())  # the counters of the timed calls only
    drafts = max(d["num_drafts"], 1)
    for o in outs:
        print(f"\n--- {o.prompt!r}\n{o.text}")
    print(f"\nspeculative decoding, {llm.engine.spec.method} K={llm.engine.spec.num_speculative_tokens}: "
          f"{n_tokens(outs) / median(t_spec):.1f} tok/s")
    print(f"mean acceptance length: {1 + d['num_accepted_tokens'] / drafts:.2f} tokens per target step")
    print("acceptance per draft position:", " ".join(f"{a / drafts:.2f}" for a in d["accepted_per_position"]))
    per_round = " ".join(f"{p / s:.2f}" for p, s in zip(t_plain, t_spec))
    print(f"speedup over plain decoding: {median(t_plain) / median(t_spec):.2f}x (rounds: {per_round})")
    if args.temperature == 0:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, plain))
        print(f"greedy outputs equal to plain decoding: {same} of {len(outs)}")


if __name__ == "__main__":
    main()
