"""Issue 28's scenario: streams decoding when a long prompt arrives, through LLMEngine.step.

Random bf16 Llama-3.1-8B weights made on the device (scripts/bench_common.py's), ``--streams``
sequences injected with ``--ctx`` tokens of random KV already cached, decoding greedily;
after ``--before`` steps one ``--prompt-len``-token prompt arrives. Reported per engine
(mixed: decode rows and prefill chunks in one step, jspec/engine/mixed.py; unmixed:
``max_num_partial_prefills=0``, prefill steps apart):
  - inter-token latency of the decoding streams (every gap between two tokens of a
    stream, over the whole run: before, during and after the long prompt's prefill):
    median, p90, p99, max, and p99 / median (the issue asks <= 4);
  - the long prompt's TTFT (add_request to its first token; the issue: within 1.5x of
    the unmixed engine's 0.40 s on the H200);
  - the engine's shape count and warmup time (every shape compiled before timing).

    python scripts/bench_mixed.py                    # 8B shape, mixed and unmixed (GPU)
    python scripts/bench_mixed.py --small            # tiny model on CPU, about a minute
    python scripts/bench_mixed.py --check ...        # first: mixed == unmixed greedy outputs (tiny model)
Results go to $OUT/bench_mixed.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # bench_common.py, and this checkout's jspec
from bench_common import LLAMA_8B, TINY, clear, inject, random_tree  # noqa: E402

from jspec.checkpoint.target import target_param_spec  # noqa: E402
from jspec.engine.flat_input import describe_shapes  # noqa: E402
from jspec.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from jspec.sampling_params import SamplingParams  # noqa: E402


def make_engine(cfg, params, args, mixed: bool) -> LLMEngine:
    page = 16
    max_len = args.prompt_len + args.after * 2 + 16
    pages = args.streams * -(-(args.ctx + args.before + args.after * 2 + 64) // page) + -(-max_len // page) + 8
    ec = EngineConfig(
        model=f"random-{cfg.family}", dtype=args.dtype, max_num_seqs=args.streams + 1, max_model_len=max_len,
        page_size=page, num_pages=pages, enable_prefix_caching=False, max_prefill_chunk=args.chunk,
        max_num_batched_tokens=args.batched_tokens, max_num_partial_prefills=args.partial if mixed else 0,
    )
    return LLMEngine(ec, preloaded=(cfg, params))


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def scenario(eng: LLMEngine, args, rng) -> dict:
    seqs = inject(eng, args.streams, args.ctx, rng, max_tokens=args.before + 4 * args.after + 1000)
    ids = {s.request_id for s in seqs}
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    prompt = [int(t) for t in rng.integers(0, eng.model_cfg.vocab_size, args.prompt_len)]
    t_arrive = ttft = None
    n_prefill_steps, step = 0, 0
    while True:
        if step == args.before:
            eng.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            t_arrive = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        step += 1
        for o in outs:
            if o.request_id in ids:
                stamps[o.request_id] += [now] * (len(o.outputs[0].token_ids) - len(stamps[o.request_id]))
            elif o.request_id == "long" and ttft is None and o.outputs[0].token_ids:
                ttft = now - t_arrive
        if t_arrive is not None and ttft is None:
            n_prefill_steps += 1
        if ttft is not None and step >= args.before + n_prefill_steps + args.after:
            break
    clear(eng)
    gaps = [b - a for ts in stamps.values() for a, b in zip(ts[:-1], ts[1:])]
    med = statistics.median(gaps)
    return dict(itl_median_ms=med * 1e3, itl_p90_ms=pct(gaps, 90) * 1e3, itl_p99_ms=pct(gaps, 99) * 1e3,
                itl_max_ms=max(gaps) * 1e3, p99_over_median=pct(gaps, 99) / med, ttft_s=ttft,
                steps_until_first_token=n_prefill_steps, num_gaps=len(gaps))


def check(cfg, params) -> dict:
    """Greedy outputs of requests arriving at chosen steps, mixed engine vs unmixed, on this
    backend's kernels (the tiny model in float32)."""
    arrivals = [(0, 5), (0, 100), (3, 7), (5, 150), (9, 40), (12, 3), (12, 64)]  # (step, prompt length)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for _, n in arrivals]
    outs = {}
    for partial in (2, 0):
        ec = EngineConfig(model="random-check", dtype="float32", max_num_seqs=4, max_model_len=256, page_size=16,
                          num_pages=96, max_prefill_chunk=32, max_num_partial_prefills=partial)
        eng = LLMEngine(ec, preloaded=(cfg, params))
        done, step = {}, 0
        while step <= arrivals[-1][0] or eng.has_unfinished_requests():
            for i, (at, _) in enumerate(arrivals):
                if at == step:
                    eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
            step += 1
        outs[partial] = (done, eng.stats()["num_mixed_steps"])
    same = sum(outs[2][0][k] == outs[0][0][k] for k in outs[0][0])
    res = dict(requests=len(arrivals), same_outputs=same, mixed_steps=outs[2][1])
    print(f"check: {same} of {len(arrivals)} greedy outputs equal mixed vs unmixed ({outs[2][1]} mixed steps)",
          flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a tiny model and short prompt: a CPU check of the script")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512, help="context of each decoding stream")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--before", type=int, default=20, help="decode steps before the long prompt arrives")
    ap.add_argument("--after", type=int, default=20, help="decode steps after its first token")
    ap.add_argument("--chunk", type=int, default=256, help="max_prefill_chunk")
    ap.add_argument("--batched-tokens", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    ap.add_argument("--partial", type=int, default=2, help="max_num_partial_prefills of the mixed engine")
    ap.add_argument("--engines", default="mixed,unmixed")
    ap.add_argument("--check", action="store_true", help="first: mixed == unmixed greedy outputs on a tiny model")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    cfg = LLAMA_8B
    if args.small:
        cfg = dataclasses.replace(TINY, num_layers=2)
        args.streams, args.ctx, args.prompt_len, args.chunk, args.partial = 2, 16, 40, 16, 1
        args.before, args.after, args.dtype = 3, 3, "float32"
    info = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                args=vars(args))
    print(info, flush=True)
    results = dict(info=info)
    if args.check:
        tiny = dataclasses.replace(TINY, num_layers=2)
        results["check"] = check(tiny, random_tree(target_param_spec(tiny), "float32", seed=1))
    params = random_tree(target_param_spec(cfg), args.dtype, seed=0)
    for name in args.engines.split(","):
        eng = make_engine(cfg, params, args, mixed=name == "mixed")
        shapes = eng.warmup_shapes()
        t = time.perf_counter()
        eng.warmup()
        row = dict(shapes=describe_shapes(shapes), warmup_s=time.perf_counter() - t,
                   max_num_batched_tokens=eng.scheduler.cfg.max_num_batched_tokens)
        n0 = eng.runner.num_compilations
        row.update(scenario(eng, args, np.random.default_rng(0)))
        row["compiled_during_run"] = eng.runner.num_compilations - n0
        results[name] = row
        print(f"{name}: {row['shapes']}, warmup {row['warmup_s']:.1f} s; ITL median {row['itl_median_ms']:.2f} ms, "
              f"p99 {row['itl_p99_ms']:.2f} ms ({row['p99_over_median']:.2f}x), max {row['itl_max_ms']:.1f} ms; "
              f"long prompt TTFT {row['ttft_s']:.3f} s over {row['steps_until_first_token']} steps; "
              f"{row['compiled_during_run']} compilations during the run", flush=True)
        del eng
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_mixed.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
