"""Where one decode step's GPU time goes, by kernel: a target shape with random bf16 weights
through the engine (batch 1, ctx 512 unless --batch / --ctx), then the jitted step alone
under the profiler.

    PYTHONPATH=.:scripts python3 scripts/step_profile.py --model qwen3-30b-a3b   # H100: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    PYTHONPATH=.:scripts python3 scripts/step_profile.py --model tiny            # CPU smoke test (no profile)
    PYTHONPATH=.:scripts python3 scripts/step_profile.py --model gpt-oss-20b     # MXFP4 experts, dummy weights
    PYTHONPATH=.:scripts python3 scripts/step_profile.py --model gpt-oss-20b --host   # ... and the host's time
    PYTHONPATH=.:scripts python3 scripts/step_profile.py --model llama-8b --quantization fp8   # FP8 projections

--q 16: the target forward of a verification step (16 tokens) instead of the decode step.
Prints the engine's step time (LLMEngine.step, async scheduling), the jitted step's wall
time waited and back to back, then from the profiler's kernel records: GPU busy time per
step, kernels per step, each call's span (first kernel start to last end), and the top
kernels with their launches per step. --host: then the host's side of back-to-back steps,
each host event's time a step (gpu_trace.host_times: the executable's and a CUDA graph's
launch and update, argument handling, Python frames). With OUT set, the printed lines also
go to $OUT/step_profile_<model>[_<quantization>]_q<Q>_b<batch>.log. Raw results:
docs/bench/*_step_profile_*.log, *_host_trace_*.log.
"""

from __future__ import annotations

import argparse
import collections
import os

import bench_common
import jax
import jax.numpy as jnp
import numpy as np
from bench_common import (
    LLAMA_8B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    TINY,
    engine_decode,
    inject,
    make_engine,
    random_tree,
    step_input,
    timeit,
    verify_schedule,
)
from gpu_trace import host_times, traced_events

from jspec.checkpoint.target import target_param_spec

MODELS = {"llama-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}
GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b", "gpt-oss-tiny")  # config.json written, weights drawn packed


def gpt_oss_engine(name, B, ctx):
    """An engine on a gpt-oss config (scripts/bench_gpt_oss.py's) with load_format="dummy", so
    the experts are MXFP4-packed as shipped; KV left as allocated (zeros read as fast)."""
    import tempfile

    from bench_gpt_oss import target_json, write

    from jspec.engine.llm_engine import EngineConfig, LLMEngine

    folder = write(os.path.join(tempfile.mkdtemp(prefix="jspec_step_profile_"), "target"),
                   target_json(name.removeprefix("gpt-oss-")))
    pages_per_seq = -(-(ctx + 64) // 16) + 2
    ec = EngineConfig(model=folder, dtype="bfloat16", load_format="dummy", max_num_seqs=max(8, B),
                      max_model_len=ctx + 64, page_size=16, num_pages=max(8, B) * pages_per_seq + 4,
                      enable_prefix_caching=False)
    return LLMEngine(ec)


def spans(events):
    """(start, end) of each call: events split where the GPU idles > 200 us."""
    evs = sorted(events, key=lambda e: e[2])
    out, start, end = [], evs[0][2], evs[0][2] + evs[0][1]
    for _, ns, t0 in evs[1:]:
        if t0 - end > 200_000:
            out.append((start, end))
            start = t0
        end = max(end, t0 + ns)
    return out + [(start, end)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS) + list(GPT_OSS), default="qwen3-30b-a3b")
    ap.add_argument("--reps", type=int, default=10, help="profiled steps")
    ap.add_argument("--top", type=int, default=24, help="kernels listed")
    ap.add_argument("--q", type=int, default=1, help="tokens per row: Q > 1 profiles the target forward of a "
                    "verification step (the last token and Q - 1 drafts)")
    ap.add_argument("--batch", type=int, default=1, help="decode rows")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the target's projections FP8 per channel, quantized at load (as scripts/bench.py)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens each row has in the KV cache")
    ap.add_argument("--host", action="store_true", help="also each host event's time a step, back to back")
    args = ap.parse_args()
    bench_common.QUANTIZATION = args.quantization
    out_dir = os.environ.get("OUT")
    log = open(os.path.join(out_dir, f"step_profile_{args.model}{'_' + args.quantization if args.quantization else ''}"
                                     f"_q{args.q}_b{args.batch}.log"), "w") if out_dir else None

    def say(line: str):  # printed, and kept under $OUT when set
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    rng = np.random.default_rng(0)
    B, ctx = args.batch, args.ctx
    if args.model in GPT_OSS:
        eng = gpt_oss_engine(args.model, B, ctx)
    else:
        cfg = MODELS[args.model]
        params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
        eng = make_engine(cfg, params, max_num_seqs=max(8, B), ctx=ctx, dtype="bfloat16")
    step, tps, _ = engine_decode(eng, B, ctx, rng, 32)
    say(f"{args.model}: engine step {step * 1e3:.3f} ms ({tps:.1f} tok/s)")
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    r = eng.runner
    inp = step_input(eng, verify_schedule(seqs, args.q), args.q)

    def ten():
        for _ in range(10):
            out = r.run(inp)
        return out

    say(f"jitted step: {timeit(lambda: r.run(inp), reps=30) * 1e3:.3f} ms waited, "
        f"{timeit(ten, reps=5) / 10 * 1e3:.3f} ms back to back")
    if args.host:
        say(f"host, {args.reps} steps back to back (profiled):")
        for name, (us, n) in list(host_times(lambda: r.run(inp), reps=args.reps).items())[:args.top]:
            say(f"  {us:8.1f} us/step  x{n:5.1f}  {name[:90]}")
    if jax.default_backend() != "gpu":
        return
    events = traced_events(lambda: r.run(inp), [()], reps=args.reps)
    tot, cnt = collections.Counter(), collections.Counter()
    for name, ns, _ in events:
        tot[name] += ns
        cnt[name] += 1
    # a call's input copies can show as a short span of their own: the reps longest are the steps
    span_us = sorted(((b - a) / 1e3 for a, b in spans(events)), reverse=True)[:args.reps]
    say(f"GPU busy {sum(tot.values()) / args.reps / 1e3:.1f} us/step, {len(events) / args.reps:.0f} kernels/step, "
        f"span of a step (median) {span_us[len(span_us) // 2]:.1f} us")
    for name, ns in tot.most_common(args.top):
        say(f"  {ns / args.reps / 1e3:8.1f} us/step  x{cnt[name] / args.reps:5.1f}  {name[:90]}")


if __name__ == "__main__":
    main()
