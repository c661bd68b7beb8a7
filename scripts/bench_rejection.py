"""Benchmark the rejection sampler on the GPU (H200): kernel vs jnp reference.

Usage: python scripts/bench_rejection.py [--impl gpu] [--quick]
1. Checks kernel == reference (tokens and counts) on the GPU for a few configurations.
2. Times kernel and reference (median of jitted calls after warmup, block_until_ready,
   inputs rotated over 3 buffers so no call reuses the previous one's data) for
   B in {1, 32, 256} x K in {3, 7, 15} x V in {32000, 128256, 151936}, sampled requests,
   bf16 logits, no draft probs (one-hot q), every request with K drafts.
3. At B=64, K=7, V=128256: a tuning sweep (blocks per program x warps x pipeline stages), the
   statistics kernel alone (sampled and greedy rows), and the rate of reading the target
   logits (whole rejection_sample call, default and best tuning) against the best of two
   bf16 read-only reductions measured in the same run.
   Then the same by GPU time from the profiler's kernel records (gpu_time(), via
   scripts/gpu_trace.py: one call at a time, sum of its kernels' durations, the probe timed
   the same way): the figures docs/benchmarks.md uses, since the wall-clock harness also
   times host launches and lets XLA merge reference reductions across calls.
All timed calls pass filtering="off" (what the engine passes when no request uses top-k /
top-p) unless labelled "auto".
Writes bench_rejection.json and bench_rejection.md to $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.kernel_backend import GPU, TPU, parse_impl, platform_kernels  # noqa: E402
from kernels_pallas.rejection_sampling import gpu_kernels, rejection_sample, tpu_kernels  # noqa: E402


def make_inputs(rng, b, k, v, n_rot=3, with_probs=False, dtype=jnp.bfloat16):
    sets = []
    for _ in range(n_rot):
        key = jax.random.PRNGKey(int(rng.integers(0, 2**31)))  # made on the device: B=256 is GBs
        logits = (jax.random.normal(key, (b, k + 1, v), jnp.float32) * 2 + 0.1).astype(dtype)
        fav = np.asarray(jnp.argmax(logits[:, :k], -1)) if k else np.zeros((b, 0), np.int64)
        drafts = np.where(rng.random((b, k)) < 0.8, fav, rng.integers(0, v, (b, k)))
        probs = None
        if with_probs:
            probs = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (b, k, v), jnp.float32), -1)
        temp = np.where(rng.random(b) < 0.2, 0.0, rng.uniform(0.5, 1.2, b)).astype(np.float32)
        temp[0] = 0.8  # at least one sampled request: the kernel path, not the greedy fast path
        sets.append((
            logits, jnp.asarray(drafts, jnp.int32), jnp.full((b,), k, jnp.int32), probs,
            jnp.asarray(temp), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32),
            jnp.asarray(rng.integers(1, 2**31, b), jnp.uint32), jnp.asarray(rng.integers(1, 4000, b), jnp.int32)))
    return sets


def timeit(fn, sets, warmup=2, iters=7, calls=16):
    """Seconds per call of fn, measured on the device: one jit runs `calls` calls over the
    rotating input sets (drafts and positions shifted per call, so XLA cannot merge them),
    so the ~0.1-0.2 ms of per-dispatch host latency is spread over `calls` calls.
    Median over `iters` timed runs."""

    @jax.jit
    def many(sets):
        acc = jnp.float32(0)
        for c in range(calls):
            args = list(sets[c % len(sets)])
            # Distinct operands per call: XLA would otherwise CSE repeated (side-effect free)
            # kernel calls on the same set, and time a fraction of them.
            if len(args) > 2:
                args[1] = (args[1] + c) % args[0].shape[-1]  # draft tokens -> the kernel's operands
            args[-1] = args[-1] + c  # positions: a different RNG stream per call
            out = fn(*args)
            acc = acc + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))
        return acc

    for _ in range(warmup):
        jax.block_until_ready(many(sets))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(many(sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls


def jitted(impl, filtering="auto", **tuning):
    """rejection_sample, jitted, on the kernels ``impl`` names (an EngineConfig.sample_impl
    name; "reference": the jnp path; "auto": this backend's kernels) with the GPU kernels' ``tuning``."""
    match parse_impl(impl, "--impl") or platform_kernels(jax.default_backend()):
        case GPU(interpret=interpret):
            kernels = gpu_kernels(interpret=interpret, **tuning)
        case TPU(interpret=interpret):
            kernels = tpu_kernels(interpret=interpret)
        case _:
            kernels = None
    return jax.jit(lambda *a: rejection_sample(*a, kernels=kernels, filtering=filtering))


def check(impl, rng):
    rows = []
    for b, k, v, probs in [(8, 3, 32000, False), (8, 3, 32000, True), (16, 7, 151936, False),
                           (16, 7, 128256, True), (4, 0, 128256, False), (64, 7, 128256, False)]:
        args = make_inputs(rng, b, k, v, n_rot=1, with_probs=probs)[0]
        want = jitted("reference")(*args)
        for tuning in (dict(), dict(blocks_per_program=4, num_warps=8, num_stages=3),
                       dict(blocks_per_program=16, num_warps=2)):
            got = jitted(impl, **tuning)(*args)
            same_rows = np.all(np.asarray(got[0]) == np.asarray(want[0]), axis=1) & (
                np.asarray(got[1]) == np.asarray(want[1]))
            ok = bool(same_rows.all())
            rows.append({"B": b, "K": k, "V": v, "draft_probs": probs, "tuning": str(tuning), "equal": ok,
                         "requests_differing": int((~same_rows).sum())})
            print(f"check B={b} K={k} V={v} probs={probs} {tuning}: {'OK' if ok else 'MISMATCH'} "
                  f"({int((~same_rows).sum())} of {b} requests differ)", flush=True)
    return rows


def probe_bandwidth():
    """Same-run HBM read bandwidth: the best of a bf16 row reduction and a bf16 column
    reduction over 2 GiB, one call per buffer inside one jit (no CSE, no sibling fusion).
    (No elementwise probe: timeit sums each output, and XLA would fuse that sum into the
    elementwise op and never write its output.)"""
    big = [jnp.full((1 << 30,), 1.0 + i, jnp.bfloat16) for i in range(2)]
    # c enters before the reduction: every call is a distinct computation.
    probes = {
        "bf16_row_reduction": lambda x, c: jnp.sum(x.reshape(-1, 8192).astype(jnp.float32) + c, axis=1),
        "bf16_col_reduction": lambda x, c: jnp.sum(x.reshape(-1, 4096).astype(jnp.float32) + c, axis=0),
    }
    out = {name: big[0].nbytes / timeit(jax.jit(fn), [(x, jnp.float32(0)) for x in big], calls=2) / 1e12
           for name, fn in probes.items()}
    del big
    print("probe TB/s:", {k: round(v, 3) for k, v in out.items()}, flush=True)
    return max(out.values()), out


def bandwidth(impl, rng):
    """B=64, K=7, V=128256: tuning sweep, whole call vs reference, statistics kernel alone,
    against the same-run probe. The engine passes filtering="off"/"on" (decided on the
    host), so that is the headline call; "auto" with device params (a lax.cond) is kept
    as a second row."""
    from kernels_pallas import rejection_sampling as rs

    b, k, v = 64, 7, 128256
    sets = make_inputs(rng, b, k, v)
    nbytes = b * (k + 1) * v * 2
    bw, probes = probe_bandwidth()
    sweep = {}
    for bpp in (1, 4):
        for nw in (1, 2, 4):
            for st in (1,):
                t = timeit(jitted(impl, filtering="off", blocks_per_program=bpp, num_warps=nw, num_stages=st), sets)
                sweep[(bpp, nw, st)] = t
                print(f"  sweep blocks={bpp} warps={nw} stages={st}: {t * 1e6:7.1f} us "
                      f"({nbytes / t / 1e12:.2f} TB/s, {nbytes / t / 1e12 / bw:.1%})", flush=True)
    best = min(sweep, key=sweep.get)
    bt = dict(blocks_per_program=best[0], num_warps=best[1], num_stages=best[2])
    t_kernel = timeit(jitted(impl, filtering="off"), sets)  # default tuning
    t_ref = timeit(jitted("reference", filtering="off"), sets)
    t_auto = timeit(jitted(impl), sets)  # "auto" inside a jit: lax.cond on the device
    t_ref_auto = timeit(jitted("reference"), sets)
    # The statistics kernel alone (the part that reads the logits), best tuning.
    d = jnp.zeros((b, k + 1), jnp.int32)
    mode = jnp.full((b, k + 1), rs._RESIDUAL, jnp.int32)
    one = jnp.ones((b, k + 1), jnp.float32)
    ninf = jnp.full((b, k + 1), -jnp.inf, jnp.float32)
    stats = jax.jit(lambda x, c: rs._stats_gpu(x, d + c, mode, one, ninf, interpret=impl == "interpret", bpp=best[0],
                                               num_warps=best[1], num_stages=best[2]))
    t_stats = timeit(stats, [(s[0], jnp.int32(0)) for s in sets])
    gmode = jnp.full((b, k + 1), rs._GREEDY, jnp.int32)
    gstats = jax.jit(lambda x, c: rs._stats_gpu(x, d + c, gmode, one, ninf, interpret=impl == "interpret", bpp=best[0],
                                                num_warps=best[1], num_stages=best[2]))
    t_gstats = timeit(gstats, [(s[0], jnp.int32(0)) for s in sets])
    tb = lambda t: nbytes / t / 1e12  # noqa: E731
    out = {"B": b, "K": k, "V": v, "logit_bytes": nbytes, "probe_TBps": bw, "probes_TBps": probes,
           "kernel_s": t_kernel, "kernel_TBps": tb(t_kernel), "reference_s": t_ref,
           "best_tuning": bt, "best_s": sweep[best], "best_TBps": tb(sweep[best]),
           "reference_speedup_default": t_ref / t_kernel, "reference_speedup_best": t_ref / sweep[best],
           "stats_kernel_s": t_stats, "stats_kernel_TBps": tb(t_stats),
           "greedy_stats_kernel_s": t_gstats, "greedy_stats_kernel_TBps": tb(t_gstats),
           "auto_in_jit_kernel_s": t_auto, "auto_in_jit_reference_s": t_ref_auto,
           "sweep_us": {f"blocks{a}_w{c}_st{w}": t * 1e6 for (a, c, w), t in sweep.items()}}
    print(f"bandwidth at B=64 K=7 V=128256, probe {bw:.2f} TB/s (best of {len(probes)}): "
          f"rejection_sample default tuning {t_kernel * 1e6:.1f} us = {tb(t_kernel):.2f} TB/s ({tb(t_kernel) / bw:.1%}); "
          f"best {bt} {sweep[best] * 1e6:.1f} us = {tb(sweep[best]):.2f} TB/s ({tb(sweep[best]) / bw:.1%}); "
          f"jnp reference {t_ref * 1e6:.1f} us (speedup {t_ref / t_kernel:.2f}x default, {t_ref / sweep[best]:.2f}x best); "
          f"stats kernel alone sampled {t_stats * 1e6:.1f} us = {tb(t_stats):.2f} TB/s ({tb(t_stats) / bw:.1%}), "
          f"greedy {t_gstats * 1e6:.1f} us ({tb(t_gstats) / bw:.1%}); "
          f"'auto' in a jit (lax.cond): kernel {t_auto * 1e6:.1f} us, reference {t_ref_auto * 1e6:.1f} us", flush=True)
    try:
        out["gpu_time"] = gpu_time(impl, sets, nbytes, list(sweep))
    except Exception as e:  # keep the wall-clock results of this run
        print(f"GPU-time section failed: {type(e).__name__}: {e}", flush=True)
    return out


def gpu_time(impl, sets, nbytes, tunings):
    """The same B=64 K=7 V=128256 calls by GPU time from the profiler's kernel records
    (scripts/gpu_trace.py): the statistics kernel's own duration, each whole call's GPU
    busy time (every kernel it ran), and the probe reductions timed the same way. The
    tunings (blocks, warps, stages) are swept again by GPU time; "best" is the fastest."""
    from gpu_trace import device_times, kernel_us

    big = jnp.full((1 << 30,), 1.0, jnp.bfloat16)
    probes = {
        "bf16_row_reduction": jax.jit(lambda x: jnp.sum(x.reshape(-1, 8192).astype(jnp.float32), axis=1)),
        "bf16_col_reduction": jax.jit(lambda x: jnp.sum(x.reshape(-1, 4096).astype(jnp.float32), axis=0)),
    }
    probe = {n: big.nbytes / device_times(f, [(big,)], reps=5)["busy_us"] / 1e6 for n, f in probes.items()}
    del big
    bw = max(probe.values())
    res = {"probe_TBps": probe}
    sweep = {}
    for bpp, nw, st in tunings:
        t = device_times(jitted(impl, filtering="off", blocks_per_program=bpp, num_warps=nw, num_stages=st), sets, reps=5)
        sweep[(bpp, nw, st)] = kernel_us(t, "rejection_stats")
        print(f"GPU-time sweep blocks={bpp} warps={nw} stages={st}: statistics kernel {sweep[(bpp, nw, st)]:.1f} us "
              f"({nbytes / sweep[(bpp, nw, st)] / 1e6 / bw:.1%}), whole call {t['busy_us']:.1f} us", flush=True)
    b = min(sweep, key=sweep.get)
    best = dict(blocks_per_program=b[0], num_warps=b[1], num_stages=b[2])
    res["sweep_stats_kernel_us"] = {str(k): v for k, v in sweep.items()}
    res["best_tuning"] = best
    for label, fn in (("kernel_default", jitted(impl, filtering="off")),
                      ("kernel_best", jitted(impl, filtering="off", **best)),
                      ("reference", jitted("reference", filtering="off"))):
        t = device_times(fn, sets, reps=10)
        stats = kernel_us(t, "rejection_stats")
        res[label] = {"busy_us": t["busy_us"], "stats_kernel_us": stats, "top_kernels_us": dict(list(t["kernels_us"].items())[:8])}
        line = f"GPU-time {label}: whole call {t['busy_us']:.1f} us"
        if stats:
            line += (f", statistics kernel {stats:.1f} us = {nbytes / stats / 1e6:.2f} TB/s "
                     f"({nbytes / stats / 1e6 / bw:.1%} of the {bw:.2f} TB/s probe)")
        print(line + " | " + ", ".join(f"{n[:48]} {us:.1f}" for n, us in list(t["kernels_us"].items())[:5]), flush=True)
    res["speedup_default_vs_reference"] = res["reference"]["busy_us"] / res["kernel_default"]["busy_us"]
    res["speedup_best_vs_reference"] = res["reference"]["busy_us"] / res["kernel_best"]["busy_us"]
    print(f"GPU-time probe {probe}; whole call vs reference: default {res['speedup_default_vs_reference']:.2f}x, "
          f"best {res['speedup_best_vs_reference']:.2f}x", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="gpu")
    ap.add_argument("--quick", action="store_true", help="only B=32, K=7")
    a = ap.parse_args()
    print("devices:", jax.devices(), "jax", jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    result = {"impl": a.impl, "jax": jax.__version__, "device": str(jax.devices()[0])}
    result["check"] = check(a.impl, rng)
    result["bandwidth"] = bandwidth(a.impl, rng)  # the point first: a cut-short run still answers it
    save(result, [])
    rows = []
    bs, ks = ((32,), (7,)) if a.quick else ((1, 32, 256), (3, 7, 15))
    for v in (32000, 128256, 151936):
        for b in bs:
            for k in ks:
                sets = make_inputs(rng, b, k, v)
                tk = timeit(jitted(a.impl, filtering="off"), sets)
                tr = timeit(jitted("reference", filtering="off"), sets)
                rows.append({"B": b, "K": k, "V": v, "kernel_ms": tk * 1e3, "reference_ms": tr * 1e3,
                             "speedup": tr / tk, "logits_TBps": b * (k + 1) * v * 2 / tk / 1e12})
                print(f"B={b:4d} K={k:2d} V={v:6d}  kernel {tk * 1e3:8.3f} ms  ref {tr * 1e3:8.3f} ms  "
                      f"x{tr / tk:5.2f}  {rows[-1]['logits_TBps']:.2f} TB/s", flush=True)
                del sets
                result["timings"] = rows
                save(result, rows)


def save(result, rows):
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_rejection.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "bench_rejection.md"), "w") as f:
            f.write("| B | K | V | kernel ms | reference ms | speedup | logits TB/s |\n|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['B']} | {r['K']} | {r['V']} | {r['kernel_ms']:.3f} | {r['reference_ms']:.3f} "
                        f"| {r['speedup']:.2f} | {r['logits_TBps']:.2f} |\n")
            bw = result["bandwidth"]
            f.write(f"\nB=64 K=7 V=128256: kernel {bw['kernel_TBps']:.2f} TB/s (best tuning "
                    f"{bw['best_TBps']:.2f}) vs probe {bw['probe_TBps']:.2f} TB/s\n")


if __name__ == "__main__":
    main()
