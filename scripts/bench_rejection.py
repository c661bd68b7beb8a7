"""Benchmark the rejection sampler on the GPU (H200): kernel vs jnp reference.

Usage: python scripts/bench_rejection.py [--impl gpu] [--quick]
1. Checks kernel == reference (tokens and counts) on the GPU for a few configurations.
2. Times kernel and reference (median of jitted calls after warmup, block_until_ready,
   inputs rotated over 3 buffers so no call reuses the previous one's data) for
   B in {1, 32, 256} x K in {3, 7, 15} x V in {32000, 128256, 151936}, sampled requests,
   bf16 logits, no draft probs (one-hot q), every request with K drafts.
3. At B=64, K=7, V=128256 reports the bandwidth of reading the target logits against a
   bf16 read-only reduction measured in the same run.
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

from kernels_pallas.rejection_sampling import rejection_sample  # noqa: E402


def make_inputs(rng, b, k, v, n_rot=3, with_probs=False, dtype=jnp.bfloat16):
    sets = []
    for _ in range(n_rot):
        logits = jnp.asarray(rng.normal(size=(b, k + 1, v)).astype(np.float32) * 2 + 0.1, dtype)
        fav = np.asarray(jnp.argmax(logits[:, :k], -1)) if k else np.zeros((b, 0), np.int64)
        drafts = np.where(rng.random((b, k)) < 0.8, fav, rng.integers(0, v, (b, k)))
        probs = None
        if with_probs:
            probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32), -1)
        temp = np.where(rng.random(b) < 0.2, 0.0, rng.uniform(0.5, 1.2, b)).astype(np.float32)
        temp[0] = 0.8  # at least one sampled request: the kernel path, not the greedy fast path
        sets.append((
            logits, jnp.asarray(drafts, jnp.int32), jnp.full((b,), k, jnp.int32), probs,
            jnp.asarray(temp), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32),
            jnp.asarray(rng.integers(1, 2**31, b), jnp.uint32), jnp.asarray(rng.integers(1, 4000, b), jnp.int32)))
    return sets


def timeit(fn, sets, warmup=3, iters=20):
    for i in range(warmup):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    times = []
    for i in range(iters):
        args = sets[i % len(sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jitted(impl):
    return jax.jit(lambda *a: rejection_sample(*a, impl=impl))


def check(impl, rng):
    rows = []
    for b, k, v, probs in [(8, 3, 32000, False), (8, 3, 32000, True), (16, 7, 151936, False),
                           (4, 0, 128256, False)]:
        args = make_inputs(rng, b, k, v, n_rot=1, with_probs=probs)[0]
        got = jitted(impl)(*args)
        want = jitted("reference")(*args)
        ok = bool(np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                  and np.array_equal(np.asarray(got[1]), np.asarray(want[1])))
        rows.append({"B": b, "K": k, "V": v, "draft_probs": probs, "equal": ok})
        print(f"check B={b} K={k} V={v} probs={probs}: {'OK' if ok else 'MISMATCH'}", flush=True)
    return rows


def bandwidth(impl, rng):
    b, k, v = 64, 7, 128256
    sets = make_inputs(rng, b, k, v)
    nbytes = b * (k + 1) * v * 2
    t_kernel = timeit(jitted(impl), sets)
    # Same-run reference bandwidth: a read-only bf16 reduction over ~2 GiB.
    big = [jnp.full((1 << 30,), 1.0 + i, jnp.bfloat16) for i in range(2)]
    red = jax.jit(lambda x: jnp.sum(x.reshape(-1, 4096).astype(jnp.float32), axis=0))
    t_red = timeit(red, [(x,) for x in big])
    out = {"B": b, "K": k, "V": v, "logit_bytes": nbytes, "kernel_s": t_kernel,
           "kernel_TBps": nbytes / t_kernel / 1e12, "reduction_TBps": big[0].nbytes / t_red / 1e12}
    print(f"bandwidth at B=64 K=7 V=128256: kernel reads logits at {out['kernel_TBps']:.2f} TB/s, "
          f"bf16 reduction {out['reduction_TBps']:.2f} TB/s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="gpu")
    ap.add_argument("--quick", action="store_true", help="only B=32, K=7")
    a = ap.parse_args()
    print("devices:", jax.devices(), "jax", jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    result = {"impl": a.impl, "jax": jax.__version__, "device": str(jax.devices()[0])}
    result["check"] = check(a.impl, rng)
    rows = []
    bs, ks = ((32,), (7,)) if a.quick else ((1, 32, 256), (3, 7, 15))
    for v in (32000, 128256, 151936):
        for b in bs:
            for k in ks:
                sets = make_inputs(rng, b, k, v)
                tk = timeit(jitted(a.impl), sets)
                tr = timeit(jitted("reference"), sets)
                rows.append({"B": b, "K": k, "V": v, "kernel_ms": tk * 1e3, "reference_ms": tr * 1e3,
                             "speedup": tr / tk, "logits_TBps": b * (k + 1) * v * 2 / tk / 1e12})
                print(f"B={b:4d} K={k:2d} V={v:6d}  kernel {tk * 1e3:8.3f} ms  ref {tr * 1e3:8.3f} ms  "
                      f"x{tr / tk:5.2f}  {rows[-1]['logits_TBps']:.2f} TB/s", flush=True)
                del sets
    result["timings"] = rows
    result["bandwidth"] = bandwidth(a.impl, rng)
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
            f.write(f"\nB=64 K=7 V=128256: kernel {bw['kernel_TBps']:.2f} TB/s vs bf16 reduction "
                    f"{bw['reduction_TBps']:.2f} TB/s\n")


if __name__ == "__main__":
    main()
