"""Decode benchmarks on the GPU: plain autoregressive and speculative (synthetic acceptance).

Random bf16 weights made on the device (no checkpoint), sequences injected with their KV
already in the cache (random, never zeros), then timed through the real engine loop
(``LLMEngine.step``: scheduler, runner, host bookkeeping included). Every figure is printed
next to the bound it is compared with, measured in the same run:
  - decode roofline: (non-embedding weight bytes + KV bytes read) / HBM bandwidth, the
    bandwidth being the best of a bf16 read-only reduction and an f32 read+write copy;
  - speculative: measured speedup over the same engine without speculation, against the
    physical ideal tau * T(1) / (T(1) + drafter weight bytes / bandwidth); T(K+1) / T(1)
    and the drafter's time against its bytes / bandwidth.

    python scripts/bench.py --section plain              # issue 3 / 7: batch 1..64, ctx 512 / 4096
    python scripts/bench.py --section eagle3             # issue 5
    python scripts/bench.py --section parallel           # issue 6: DFlash + PEagle on a Qwen3-8B shape
    python scripts/bench.py --section structured         # issue 27: tok/s with and without a JSON schema
    python scripts/bench.py --section warmup             # issue 28: warmup time, serial / threaded compiles
    python scripts/bench.py --section moe --spec-batches 1,8   # a Qwen3-30B-A3B-shaped MoE target
    python scripts/bench.py --quick ...                  # tiny shapes: a CPU smoke test of the script
Results go to $OUT/bench_<section>.json when OUT is set. This file holds the command line and
the sections through the engine loop (plain, diag, verify, eagle3 / parallel, warmup); the
sections through jspec.LLM (llm, moe, structured) are in bench_llm.py, and what every
benchmark shares (shapes, probes, engines, timing) in bench_common.py.
"""

from __future__ import annotations

# XLA flags are left at their defaults: on jax 0.11.2 / H200 (2026-11-21, this script's
# diag section) the default GEMV path streamed weights at 3.10 TB/s, and
# --xla_gpu_enable_triton_gemm=false at 0.76 TB/s -- the reverse of an earlier note. Without
# command buffers (--xla_gpu_enable_command_buffer=), XLA's PDL (on by default in 0.11.2)
# makes batch-1 decode as fast as the default CUDA graphs, not faster (2026-11-22).
import argparse
import json
import os
import time

import bench_common
import jax
import jax.numpy as jnp
import numpy as np
from bench_common import (
    LLAMA_8B,
    QWEN3_8B,
    TINY,
    draft_time,
    drafter_setup,
    drafter_stream_bytes,
    engine_decode,
    inject,
    make_engine,
    measure_bandwidth,
    physical_ideal,
    random_tree,
    spec_step_kernels,
    step_input,
    target_forward_time,
    timeit,
    weight_bytes,
)
from bench_llm import llm_section, moe_section, structured_section

from jspec.checkpoint.target import quantize_target, target_param_spec
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.warmup import run_warmup


def held_weight_bytes(cfg, params) -> int:
    """weight_bytes of the tree the engine holds under --quantization (FP8 weights: a byte each),
    from its shapes alone (the engine quantizes its own copy)."""
    return weight_bytes(jax.eval_shape(lambda p: quantize_target(cfg, p, bench_common.QUANTIZATION, "bfloat16")[1],
                                       params))


def plain_section(args, bw):
    cfg = TINY if args.quick else LLAMA_8B
    dtype = "bfloat16"
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    wbytes = held_weight_bytes(cfg, params)
    rng = np.random.default_rng(0)
    rows = []
    kv_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bytes per token, bf16
    # (steps per call, async scheduling, batch-1 / first-context only): the full table runs
    # with args.sched_steps and async on; batch 1 also without async and with 1 step per call.
    runs = [(1, False, True), (1, True, True)] if args.sched_steps > 1 else []
    runs += [(args.sched_steps, False, True)] if not args.no_sync_rows else []
    runs.append((args.sched_steps, True, False))
    ctxs = [int(c) for c in args.contexts.split(",")] if not args.quick else (64, 256)
    for steps_per_call, asyn, only_b1 in runs:
        for ctx in ctxs:
            if only_b1 and ctx != ctxs[0]:
                continue
            eng = make_engine(cfg, params, max_num_seqs=64 if not args.quick else 8, ctx=ctx, dtype=dtype,
                              sched_steps=steps_per_call, extra=64 + steps_per_call * (args.steps + 8),
                              async_scheduling=asyn)
            for B in [int(b) for b in args.batches.split(",")] if not args.quick else (1, 8):
                if only_b1 and B != 1:
                    continue
                c0 = eng.num_chained_calls
                step, tps, digest = engine_decode(eng, B, ctx, rng, args.steps)
                step = B / tps  # per generated token of each row: multi-step calls emit several
                bound = (wbytes + B * ctx * kv_tok) / (bw["best_TBps"] * 1e12)
                rows.append(dict(batch=B, ctx=ctx, num_scheduler_steps=steps_per_call, async_scheduling=asyn,
                                 roofline_bytes=wbytes + B * ctx * kv_tok,
                                 chained_calls=eng.num_chained_calls - c0, step_ms=step * 1e3, tok_s=tps,
                                 roofline_ms=bound * 1e3, roofline_frac=bound / step, tokens_crc=digest,
                                 attn_impl=eng.runner.plan.attn.name,
                                 linear_impl=eng.runner.plan.linear.name))
                print(f"plain B={B:3d} ctx={ctx:5d} sched_steps={steps_per_call} async={int(asyn)}: "
                      f"{step*1e3:7.2f} ms/token-step {tps:9.1f} tok/s roofline {bound*1e3:6.2f} ms -> "
                      f"{bound/step:5.1%} (chained calls {eng.num_chained_calls - c0}, tokens crc {digest:08x})", flush=True)
            del eng
    return dict(weight_bytes=wbytes, rows=rows)


def diag_section(args, bw):
    """Where a batch-1 step goes: engine loop vs the jitted step alone vs back-to-back steps."""
    cfg = TINY if args.quick else LLAMA_8B
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    wbytes = held_weight_bytes(cfg, params)
    rng = np.random.default_rng(0)
    eng = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16")
    step, _, _ = engine_decode(eng, 1, 512, rng, args.steps)
    seqs = inject(eng, 1, 512, rng, max_tokens=8)
    sched = SchedulerOutput("decode", [ScheduledSeq(s, 1, True) for s in seqs], [])
    r = eng.runner
    t_build = timeit(lambda: step_input(eng, sched), reps=50)
    inp = step_input(eng, sched)
    t_jit = timeit(lambda: r.run(inp), reps=30)

    def ten():
        for _ in range(10):
            out = r.run(inp)
        return out

    t_ten = timeit(ten, reps=5) / 10
    # Weight streaming alone: the MLP + attention projections as a scan-free chain of GEMVs.
    ws = [l for l in jax.tree.leaves(params) if l.ndim == 2 and l.shape[0] != cfg.vocab_size]
    x = jnp.ones((1, cfg.hidden_size), jnp.bfloat16)

    @jax.jit
    def gemvs(ws, x):
        acc = jnp.zeros((), jnp.float32)
        for w in ws:
            xi = x if w.shape[1] == x.shape[1] else jnp.ones((1, w.shape[1]), x.dtype)
            acc = acc + jnp.einsum("bd,fd->bf", xi, w, preferred_element_type=jnp.float32).sum()
        return acc

    t_gemv = timeit(lambda: gemvs(ws, x), reps=20)
    gb = sum(w.size * 2 for w in ws)
    # GPU busy time (profiler kernel records) against wall time: for one step, and for one
    # num_scheduler_steps call (a lax.scan over steps: idle time there is the XLA while
    # loop's per-iteration host round trip and launch gaps, not bytes).
    from gpu_trace import device_times

    gpu = jax.default_backend() == "gpu"  # the profiler's kernel records exist on GPU only
    one = device_times(lambda: r.run(inp), [()], reps=10) if gpu else None
    busy_one = one and one["busy_us"] / 1e3
    n = 8
    eng8 = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16", sched_steps=n)
    seqs8 = inject(eng8, 1, 512, rng, max_tokens=64)
    assert all(eng8.blocks.ensure_slots(s, 512 + n) for s in seqs8)
    inp8 = step_input(eng8, SchedulerOutput("decode", [ScheduledSeq(s, 1, True) for s in seqs8], []), steps=n)
    t_multi = timeit(lambda: eng8.runner.run(inp8, n), reps=10)
    multi = device_times(lambda: eng8.runner.run(inp8, n), [()], reps=5) if gpu else None
    busy_multi = multi and multi["busy_us"] / 1e3
    # A whole target forward (every layer + lm_head + sampling) verifying 8 tokens vs
    # decoding 1, batch 1, by GPU time: the engine-level counterpart of the attention-only
    # verify-8 / decode ratio in scripts/bench_attention.py.
    verify = {}
    if gpu:
        for ctx in (512, 4096):
            e = make_engine(cfg, params, max_num_seqs=8, ctx=ctx, dtype="bfloat16")
            for q in (1, 8):
                verify[f"ctx{ctx}_q{q}_gpu_ms"] = target_forward_time(e, 1, ctx, rng, q, gpu_time=True) * 1e3
            verify[f"ctx{ctx}_ratio"] = verify[f"ctx{ctx}_q8_gpu_ms"] / verify[f"ctx{ctx}_q1_gpu_ms"]
            del e
    out = dict(engine_step_ms=step * 1e3, build_input_ms=t_build * 1e3, jit_step_ms=t_jit * 1e3, target_verify8=verify,
               jit_step_gpu_busy_ms=busy_one, multi_call_steps=n, multi_call_ms=t_multi * 1e3,
               multi_call_gpu_busy_ms=busy_multi,
               pipelined_step_ms=t_ten * 1e3, gemv_chain_ms=t_gemv * 1e3, gemv_TBps=gb / t_gemv / 1e12,
               roofline_ms=(wbytes + 512 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2) / (bw["best_TBps"] * 1e12) * 1e3,
               attn_impl=r.plan.attn.name, linear_impl=r.plan.linear.name, xla_flags=os.environ.get("XLA_FLAGS", ""),
               # where one step's GPU time goes: us per step by kernel name, and the number of launches
               step_kernels_us={k: v / n for k, v in list(multi["kernels_us"].items())[:24]} if gpu else None)
    print("diag", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items() if k != "step_kernels_us"},
          flush=True)
    for k, v in (out["step_kernels_us"] or {}).items():
        print(f"  {v:8.1f} us/step  {k}", flush=True)
    return out


def verify_section(args, bw):
    """T(K+1) / T(1) of the target forward (every layer, lm_head and sampling) at batch 1,
    context 512, for K + 1 in {4, 8, 16}: by GPU time (the profiler's kernel records, what
    the step costs the device) and by wall clock (one synchronised call, host included)."""
    gpu = jax.default_backend() == "gpu"
    rows = []
    for name, cfg in (("llama-8b", LLAMA_8B), ("qwen3-8b", QWEN3_8B)):
        cfg = TINY if args.quick else cfg
        params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
        rng = np.random.default_rng(0)
        eng = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16")
        t = {q: (target_forward_time(eng, 1, 512, rng, q, gpu_time=gpu), target_forward_time(eng, 1, 512, rng, q))
             for q in (1, 4, 8, 16)}
        for q in (4, 8, 16):
            row = dict(model=name, q=q, gpu_ms=t[q][0] * 1e3, gpu_t1_ms=t[1][0] * 1e3, ratio_gpu=t[q][0] / t[1][0],
                       wall_ms=t[q][1] * 1e3, wall_t1_ms=t[1][1] * 1e3, ratio_wall=t[q][1] / t[1][1])
            rows.append(row)
            print(f"verify {name} Q={q:2d}: GPU {row['gpu_ms']:.3f} / {row['gpu_t1_ms']:.3f} ms = {row['ratio_gpu']:.3f}; "
                  f"wall {row['wall_ms']:.3f} / {row['wall_t1_ms']:.3f} ms = {row['ratio_wall']:.3f}", flush=True)
        del eng, params
    return dict(rows=rows)


def spec_section(args, bw, kind):
    cfg = TINY if args.quick else (LLAMA_8B if kind == "eagle3" else QWEN3_8B)
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    ctx = 256 if args.quick else 512
    plan = {  # method -> [(K, [acceptance lengths])]
        "eagle3": [(3, [2.5, 3.5]), (7, [2.5, 3.5])],
        "peagle": [(7, [3.5])],
        "dflash": [(15, [4.24, 6.5])],
    }[kind]
    dc, dparams = drafter_setup(kind, cfg, args.quick)
    dbytes = drafter_stream_bytes(cfg, dc, dparams)
    t_dbound = dbytes / (bw["best_TBps"] * 1e12)
    base = make_engine(cfg, params, max_num_seqs=32 if not args.quick else 4, ctx=ctx, dtype="bfloat16")
    rows = []
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else (1, 4)
    ks = {int(k) for k in args.ks.split(",")} if args.ks else None
    for B in batches:
        t1, base_tps, _ = engine_decode(base, B, ctx, rng, args.steps)
        for K, lengths in plan:
            if ks is not None and K not in ks:
                continue
            # T(K+1) / T(1) of the target forward by GPU time on a GPU (wall clock elsewhere).
            gpu = jax.default_backend() == "gpu"
            tK = target_forward_time(base, B, ctx, rng, K + 1, gpu_time=gpu)
            t1_fwd = target_forward_time(base, B, ctx, rng, 1, gpu_time=gpu)
            spec = {"method": kind, "model": f"random-{kind}", "num_speculative_tokens": K,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": lengths[0]}
            eng = make_engine(cfg, params, max_num_seqs=32 if not args.quick else 4, ctx=ctx, dtype="bfloat16",
                              spec=spec, drafter=(dc, dparams), extra=(args.steps + 8) * (K + 1) + 64)
            t_draft = draft_time(eng, B, ctx, rng, K)
            if args.kernels and jax.default_backend() == "gpu":
                prof = spec_step_kernels(eng, B, ctx, rng, K)
                print(f"{kind} B={B} K={K} one step: GPU busy {prof['busy_us']:.1f} us", flush=True)
                for name, us in prof["kernels_us"].items():
                    print(f"  {us:8.1f} us  {name[:110]}", flush=True)
            for length in lengths:
                from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

                eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
                eng.spec_metrics.__init__()
                step, tps, _ = engine_decode(eng, B, ctx, rng, args.steps)
                tau = eng.spec_metrics.mean_acceptance_length
                ideal = physical_ideal(tau, t1, dbytes, bw["best_TBps"] * 1e12)
                rows.append(dict(method=kind, batch=B, K=K, synthetic_length=length, tau=tau, tok_s=tps,
                                 base_tok_s=base_tps, speedup=tps / base_tps, ideal=ideal,
                                 measured_over_ideal=(tps / base_tps) / ideal, t_target1_ms=t1 * 1e3,
                                 t_targetK1_ms=tK * 1e3, t_target1_fwd_ms=t1_fwd * 1e3, t_draft_ms=t_draft * 1e3, draft_bound_ms=t_dbound * 1e3,
                                 drafter_bytes=dbytes, spec_step_ms=step * 1e3))
                print(f"{kind} B={B:2d} K={K:2d} L={length}: tau {tau:.2f} {tps:8.1f} tok/s (base {base_tps:7.1f}) "
                      f"speedup {tps/base_tps:4.2f}x physical ideal {ideal:4.2f}x -> {(tps/base_tps)/ideal:5.1%}; "
                      f"T1 {t1*1e3:.2f}; forward T(K+1) / T(1) {tK*1e3:.2f} / {t1_fwd*1e3:.2f} ms ({tK/t1_fwd:.3f}x) Tdraft {t_draft*1e3:.2f} ms "
                      f"(bytes/bw {t_dbound*1e3:.2f} ms, {t_draft/t_dbound:.2f}x)", flush=True)
            del eng
    return dict(rows=rows)


def warmup_section(args, bw):
    """Engine warmup (every shape compiled) of the 8B plain engine at max_num_seqs
    --warm-batch, one compilation at a time and on the plan's threads (jspec/engine/warmup.py, prepare),
    each on a fresh engine with jax's caches cleared (no persistent cache)."""
    cfg = LLAMA_8B
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rows = []
    for threads in (1, None):
        jax.clear_caches()
        eng = make_engine(cfg, params, max_num_seqs=args.warm_batch, ctx=args.llm_ctx, dtype="bfloat16")
        n = len(eng.warmup_shapes())
        threads = threads or eng.runner.plan.compile_threads
        t = time.perf_counter()
        run_warmup(eng.runner, 1, True, threads=threads)
        t = time.perf_counter() - t
        rows.append(dict(threads=threads, shapes=n, seconds=t, compilations=eng.runner.num_compilations))
        print(f"warmup, {n} shapes, {threads} compile thread(s): {t:.1f} s", flush=True)
        del eng
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", choices=["plain", "diag", "verify", "llm", "moe", "structured", "warmup", "eagle3",
                                         "parallel", "all"],
                    default="plain")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,8,32,64", help="plain section: batch sizes")
    ap.add_argument("--contexts", default="512,4096", help="plain section: contexts (the first one also gets "
                    "the batch-1 rows without async / with one step per call)")
    ap.add_argument("--sched-steps", type=int, default=8, help="num_scheduler_steps for the plain section")
    ap.add_argument("--no-sync-rows", action="store_true", help="plain section: skip the async-off batch-1 row")
    ap.add_argument("--linear-impl", default="auto", help="EngineConfig.linear_impl (auto | reference | gpu)")
    ap.add_argument("--attn-impl", default="auto", help="EngineConfig.attn_impl (auto | reference | gpu | tpu)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the target's projections as FP8, quantized per output channel (vLLM's online fp8); "
                         "the rooflines count the weights' bytes so")
    ap.add_argument("--spec-batches", default="1,32", help="eagle3/parallel sections: batch sizes")
    ap.add_argument("--ks", default="", help="eagle3/parallel sections: only these K (default: the plan's)")
    ap.add_argument("--methods", default="dflash,peagle", help="parallel / llm sections: which drafters")
    ap.add_argument("--llm-ctx", type=int, default=512, help="llm section: prompt tokens")
    ap.add_argument("--llm-new", type=int, default=256, help="llm section: generated tokens")
    ap.add_argument("--dynamic", action="store_true", help="llm section: speculative_config 'dynamic' (each "
                    "decode step's width chosen as pays, as at saturation), to show batch 1 keeps its speedup")
    ap.add_argument("--warm-batch", type=int, default=4, help="warmup section: max_num_seqs")
    ap.add_argument("--llm-reps", type=int, default=1, help="llm / structured sections: timed runs per figure "
                    "(their median; each run's time printed when more than one)")
    ap.add_argument("--kernels", action="store_true", help="eagle3/parallel sections: profile one speculative "
                    "step per (batch, K) and print its GPU time by kernel")
    args = ap.parse_args()
    # Module state of bench_common, read by its engines and jspec.LLM keywords at call time.
    bench_common.LINEAR_IMPL, bench_common.ATTN_IMPL = args.linear_impl, args.attn_impl
    bench_common.PROFILE_DRAFT, bench_common.LLM_REPS = args.kernels, args.llm_reps
    bench_common.QUANTIZATION = args.quantization
    info = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                backend=jax.default_backend(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                linear_impl=bench_common.LINEAR_IMPL, attn_impl=bench_common.ATTN_IMPL,
                quantization=bench_common.QUANTIZATION)
    print(info, flush=True)
    bw = measure_bandwidth(args.quick)
    print("bandwidth", {k: round(v, 3) for k, v in bw.items()}, flush=True)
    results = dict(info=info, bandwidth=bw)
    if args.section == "diag":
        results["diag"] = diag_section(args, bw)
    if args.section == "llm":
        results["llm"] = llm_section(args, bw)
    if args.section == "verify":
        results["verify"] = verify_section(args, bw)
    if args.section == "moe":
        results["moe"] = moe_section(args, bw)
    if args.section == "structured":
        results["structured"] = structured_section(args, bw)
    if args.section == "warmup":
        results["warmup"] = warmup_section(args, bw)
    if args.section in ("plain", "all"):
        results["plain"] = plain_section(args, bw)
        # The probe again at the end, warm: the rooflines use the best of both.
        bw_end = measure_bandwidth(args.quick)
        print("bandwidth at the end", {k: round(v, 3) for k, v in bw_end.items()}, flush=True)
        results["bandwidth_end"] = bw_end
        best = max(bw["best_TBps"], bw_end["best_TBps"])
        print(f"plain rows against the best probe of the run, {best:.3f} TB/s:")
        for r in results["plain"]["rows"]:
            r["roofline_ms"] = r["roofline_bytes"] / (best * 1e12) * 1e3
            r["roofline_frac"] = r["roofline_ms"] / r["step_ms"]
            r["probe_TBps"] = best
            print(f"  B={r['batch']:3d} ctx={r['ctx']:5d} steps={r['num_scheduler_steps']} async={int(r['async_scheduling'])}: "
                  f"{r['step_ms']:6.2f} ms {r['tok_s']:8.1f} tok/s roofline {r['roofline_ms']:5.2f} ms -> "
                  f"{r['roofline_frac']:5.1%}", flush=True)
    if args.section in ("eagle3", "all"):
        results["eagle3"] = spec_section(args, bw, "eagle3")
    if args.section in ("parallel", "all"):
        for m in args.methods.split(","):
            results[m] = spec_section(args, bw, m)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"bench_{args.section}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
