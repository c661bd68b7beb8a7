"""Experiment: is a batch-1 GEMV kernel's time set by the bytes each program streams?

The decode step's qkv kernel (kernels_pallas/qkv_rope_kv_write.py) runs 96 programs of
2 x 32 weight rows on the H200's 132 SMs; o and down run 128 programs of 32 rows. If a
kernel's time follows the bytes per program, spreading qkv's 6144 rows over 128 programs
(48 rows each) would save a quarter of its stream. fused_linear (prologue "rmsnorm", MMA
form) on weights of equal bytes per program and different program counts tells:

    [6144, 4096] 64-row tiles:  96 programs x 524 KB   (qkv today)
    [8192, 4096] 64-row tiles: 128 programs x 524 KB   (same bytes per program)
    [8192, 3072] 64-row tiles: 128 programs x 393 KB   (qkv's bytes over 128 programs)
    [4096, 4096] 64 / 32-row tiles: 64 x 524 KB / 128 x 262 KB (o today)

Second question, the post-attention RMSNorm before XLA's gate_up GEMM (2 XLA fusions,
2.8 us per layer in the step): what XLA's gate_up costs with the norm, with only the
elementwise scale by the norm weight (the 1 / rms factored out, as fused_linear does), and
bare. Every time is profiler GPU time per call over rotating weight sets (> L2).

    PYTHONPATH=.:scripts python scripts/experiments/explore_balance.py     # GPU
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from gpu_trace import device_times
from kernels_pallas.fused_linear import fused_linear_gpu, rms_norm

SETS = 4  # rotating weight sets: >= 4 x 33.6 MB, more than the 50 MB L2


def weights(F, K, key):
    return [jax.random.normal(jax.random.fold_in(key, i), (F, K), jnp.bfloat16) * 0.02 for i in range(SETS)]


def main():
    key = jax.random.PRNGKey(0)
    results = {}
    x4 = jax.random.normal(key, (1, 4096), jnp.bfloat16)
    nw4 = 1.0 + 0.1 * jax.random.normal(jax.random.fold_in(key, 99), (4096,), jnp.bfloat16)
    cases = [  # (F, K, blocks)
        (6144, 4096, (64, 256, 4, 4, True)),
        (8192, 4096, (64, 256, 4, 4, True)),
        (8192, 3072, (64, 256, 4, 4, True)),
        (6144, 4096, (32, 256, 4, 6, True)),
        (4096, 4096, (64, 256, 4, 4, True)),
        (4096, 4096, (32, 256, 4, 6, True)),
    ]
    for F, K, blocks in cases:
        ws = weights(F, K, jax.random.fold_in(key, F * 7 + K))
        x, nw = x4[:, :K], nw4[:K]
        f = jax.jit(lambda x, w, nw, b=blocks: fused_linear_gpu(x, w, nw, prologue="rmsnorm", blocks=b))
        y = f(x, ws[0], nw)
        ref = jnp.einsum("d,fd->f", rms_norm(x[0], nw, 1e-6), ws[0], preferred_element_type=jnp.float32)
        err = float(jnp.linalg.norm(y[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        t = device_times(f, [(x, w, nw) for w in ws], reps=10)
        progs = F // blocks[0]
        name = f"fused_linear rmsnorm [{F},{K}] tiles {blocks[:4]}"
        results[name] = dict(programs=progs, kb_per_program=F * K * 2 / progs / 1024, us=t["busy_us"], rel_err=err)
        print(f"{name}: {progs} programs x {F * K * 2 / progs / 1024:.0f} KB  {t['busy_us']:.2f} us "
              f"({F * K * 2 / t['busy_us'] / 1e6:.2f} TB/s)  rel err {err:.1e}", flush=True)
        gx = jax.jit(lambda x, w: jnp.einsum("md,fd->mf", x, w))
        t = device_times(gx, [(x, w) for w in ws], reps=10)
        results[f"xla [{F},{K}]"] = dict(us=t["busy_us"])
        print(f"xla [{F},{K}]: {t['busy_us']:.2f} us", flush=True)

    ws = weights(28672, 4096, jax.random.fold_in(key, 5))
    h = x4
    paths = {
        "gate_up after rms_norm (the step's path)": lambda h, w, nw: jnp.einsum("md,fd->mf", rms_norm(h, nw, 1e-6), w),
        "gate_up of (h * norm_w), 1/rms factored out": lambda h, w, nw: jnp.einsum("md,fd->mf", h * nw, w),
        "gate_up bare": lambda h, w, nw: jnp.einsum("md,fd->mf", h, w),
    }
    for name, fn in paths.items():
        f = jax.jit(fn)
        t = device_times(f, [(h, w, nw4) for w in ws], reps=10)
        results[name] = dict(us=t["busy_us"], kernels_us=t["kernels_us"])
        print(f"{name}: {t['busy_us']:.2f} us  kernels {({k: round(v, 2) for k, v in t['kernels_us'].items()})}",
              flush=True)

    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "explore_balance.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
