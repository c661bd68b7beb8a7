"""FP8 GEMMs through XLA at prefill / large-batch shapes (issue 60: FP8 tensor cores for the
larger-batch projections): each Llama-3.1-8B layer projection at M rows, three ways,

    bf16   x bf16 @ w bf16                                   (the unquantized engine)
    w8a16  x bf16 @ (w fp8 -> bf16) * w_scale                (jspec's FP8 path today: XLA's dot)
    w8a8   (x / x_scale -> fp8) @ w fp8, f32 out * x_scale * w_scale
           (dynamic per-token activation scales, per-channel weight scales: vLLM's W8A8)

each beside the run's bf16 and FP8 matrix peaks (square GEMMs through XLA, measured in the same
run), with its relative error against the float32 product of the quantized weight (w8a8's
includes the activations' rounding to e4m3), the kernels XLA ran (whether an FP8 GEMM ran) and
its compile time (XLA's GEMM autotuning: what an engine's warmup pays for each shape).

    PYTHONPATH=.:scripts python3 scripts/bench_fp8_gemm.py --rows 8192,256     # GPU
    PYTHONPATH=.:scripts python3 scripts/bench_fp8_gemm.py --quick             # CPU smoke test

Results: $OUT/bench_fp8_gemm.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

F8 = jnp.float8_e4m3fn
DN = (((1,), (1,)), ((), ()))  # x [M, K] . w [F, K] -> [M, F]
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def bf16(x, w):
    return jax.lax.dot_general(x, w, DN, preferred_element_type=jnp.float32).astype(x.dtype)


def w8a16(x, wq, s):
    y = jax.lax.dot_general(x, wq.astype(x.dtype), DN, preferred_element_type=jnp.float32)
    return (y * s).astype(x.dtype)


def w8a8(x, wq, s):
    xf = x.astype(jnp.float32)
    xs = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), 1e-12) / 448.0
    xq = jnp.clip(xf / xs, -448.0, 448.0).astype(F8)
    y = jax.lax.dot_general(xq, wq, DN, preferred_element_type=jnp.float32)
    return (y * xs * s).astype(x.dtype)


def timed(fn, args, gpu: bool) -> tuple[float, list]:
    """(GPU time per call in s, the top kernels) on a GPU; else (wall-clock median, [])."""
    if gpu:
        from gpu_trace import device_times

        t = device_times(fn, [args], reps=10)
        return t["busy_us"] * 1e-6, [(n[:60], round(us, 1)) for n, us in list(t["kernels_us"].items())[:3]]
    from bench_common import timeit

    return timeit(lambda: fn(*args), reps=3), []


def peaks(gpu: bool) -> dict:
    """bf16 and FP8 square-GEMM FLOP/s (the best of n = 4096, 8192; 256 off the GPU)."""
    out = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8", F8)):
        fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DN, preferred_element_type=jnp.float32))
        best = 0.0
        for n in (4096, 8192) if gpu else (256,):
            a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
            b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
            fn(a, b).block_until_ready()
            best = max(best, 2 * n**3 / timed(fn, (a, b), gpu)[0])
        out[name] = best
    return out


def case(M: int, F: int, K: int, gpu: bool) -> dict:
    kx, kw = jax.random.split(jax.random.key(M + F + K))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (F, K), jnp.float32) * 0.02
    s = jnp.max(jnp.abs(w), axis=1) / 448.0
    wq = (w / s[:, None]).astype(F8)
    wd = (wq.astype(jnp.float32) * s[:, None])  # the quantized weight's values
    ref = jax.lax.dot_general(x.astype(jnp.float32), wd, DN, precision=jax.lax.Precision.HIGHEST)
    row = dict(M=M, F=F, K=K)
    for name, fn, args in (("bf16", bf16, (x, wd.astype(jnp.bfloat16))), ("w8a16", w8a16, (x, wq, s)),
                           ("w8a8", w8a8, (x, wq, s))):
        t = time.perf_counter()  # XLA's compile, its GEMM autotuning included (the engine's warmup pays it per shape)
        fj = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - t
        y = fj(*args).astype(jnp.float32)
        sec, top = timed(fj, args, gpu)
        row[name] = dict(us=sec * 1e6, flops=2 * M * F * K / sec, kernels=top, compile_s=compile_s,
                         rel_err=float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,256", help="M: tokens in one step (a prefill chunk, a decode batch)")
    ap.add_argument("--shapes", default=",".join(n for n, _, _ in SHAPES), help="which of the layer's projections")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU)")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    pk = peaks(gpu)
    print(f"{jax.devices()[0].device_kind}: matrix peaks bf16 {pk['bf16'] / 1e12:.0f}, fp8 {pk['fp8'] / 1e12:.0f} "
          f"TFLOP/s", flush=True)
    rows = []
    for M in [int(m) for m in args.rows.split(",")] if not args.quick else [64]:
        for name, F, K in [sh for sh in SHAPES if sh[0] in args.shapes.split(",")] if not args.quick \
                else [("tiny", 256, 128)]:
            r = case(M, F, K, gpu)
            r["name"] = name
            rows.append(r)
            print(f"{name:8s} M={M:5d} " + "; ".join(
                f"{k} {r[k]['us']:8.1f} us (compiled in {r[k]['compile_s']:.1f} s) {r[k]['flops'] / 1e12:5.0f} TFLOP/s "
                f"({r[k]['flops'] / pk['bf16']:.0%} of bf16's peak, {r[k]['flops'] / pk['fp8']:.0%} of fp8's) "
                f"err {r[k]['rel_err']:.1e} {r[k]['kernels'][:2]}"
                for k in ("bf16", "w8a16", "w8a8")), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_fp8_gemm.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, peaks=pk, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
