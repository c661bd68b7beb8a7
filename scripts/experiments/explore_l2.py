"""Experiment (not adopted): does a weight prefetched into L2 make the next GEMV faster?

E1 cold: flush L2 (read 512 MB) -> GEMV(W).  E2 warm: flush -> prefetch(W) -> GEMV(W),
the prefetch a Pallas kernel that reads W (optionally with evict_last). GEMV: the
fused_linear kernel (with a residual) and XLA's einsum; W [F, 4096] bf16, F 2048-8192.

Outcome on the H200 (2026-11-21, jax 0.11.2, GPU time; docs/benchmarks.md, raw
docs/bench/2026-11-21_v7_explore_l2_prefetch.json): an o_proj-sized weight (33.6 MB) read
warm takes 7.7 us against 11.3 cold, but the prefetch itself takes 11.8 us, and 50 MB or
more no longer stays in L2. It would pay only hidden under latency-bound work (batch-1
attention is ~7 us per layer, less than streaming 33.6 MB), so the engine does not use it.

    PYTHONPATH=.:scripts python scripts/experiments/explore_l2.py     # GPU
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from gpu_trace import device_times
from kernels_pallas.fused_linear import fused_linear_gpu

f32 = jnp.float32


def _prefetch_kernel(w_ref, o_ref, *, K, bd, policy):
    def body(i, acc):
        d0 = pl.multiple_of(i * bd, bd)
        t = plt.load(w_ref.at[:, pl.ds(d0, bd)], eviction_policy=policy)
        return acc + t.astype(f32)

    acc = lax.fori_loop(0, K // bd, body, jnp.zeros((w_ref.shape[0], bd), f32))
    o_ref[...] = jnp.broadcast_to(jnp.sum(acc), o_ref.shape)


@functools.partial(jax.jit, static_argnames=("rows", "bd", "policy", "warps", "stages", "interpret"))
def prefetch(w, rows=8, bd=512, policy=None, warps=4, stages=4, interpret=False):
    F, K = w.shape
    n = F // rows
    return pl.pallas_call(
        functools.partial(_prefetch_kernel, K=K, bd=bd, policy=policy),
        grid=(n,),
        in_specs=[pl.BlockSpec((rows, K), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 16), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, 16), f32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"prefetch_r{rows}",
    )(w)


def main():
    interpret = jax.default_backend() != "gpu"
    res = {}
    K = 4096
    flush_buf = jnp.ones((256 << 20,), jnp.bfloat16)  # 512 MB
    x = jax.random.normal(jax.random.PRNGKey(1), (1, K), jnp.bfloat16)
    for F in (2048, 4096, 6144, 8192):
        w = jax.random.normal(jax.random.PRNGKey(F), (F, K), jnp.bfloat16)
        res_f = jax.random.normal(jax.random.PRNGKey(3), (1, F), jnp.bfloat16)
        for consumer in ("kernel", "xla"):
            for mode in ("cold", "warm", "warm_evict_last"):
                @jax.jit
                def f(fb, w, x, res_f):
                    s = jnp.sum(fb, dtype=f32)  # the L2 flush, ordered before the rest through x
                    x = x + (s * 0).astype(x.dtype)
                    if mode != "cold":
                        p = prefetch(w, policy="evict_last" if mode == "warm_evict_last" else None,
                                     interpret=interpret)
                        x = x + (p[0, 0] * 0).astype(x.dtype)
                    if consumer == "kernel":
                        return fused_linear_gpu(x, w, residual=res_f, interpret=interpret)
                    return jnp.einsum("md,fd->mf", x, w)

                per = device_times(lambda: f(flush_buf, w, x, res_f), [()], reps=10)["kernels_us"]
                key = f"F{F}_{consumer}_{mode}"
                res[key] = per
                mb = F * K * 2 / 1e6
                gem = sum(v for k, v in per.items() if ("fused_linear" in k or "gemv" in k.lower() or "gemm" in k.lower() or "dot" in k.lower()) and "prefetch" not in k)
                pre = sum(v for k, v in per.items() if "prefetch" in k)
                print(f"{key:32s} W {mb:6.1f} MB  prefetch {pre:6.2f} us  gemv {gem:6.2f} us  "
                      f"({mb / gem if gem else 0.0:5.2f} TB/s)  all: " +
                      ", ".join(f"{k[:40]}={v:.2f}" for k, v in per.items()), flush=True)
    # prefetch kernel tunings alone on 33.5 MB (warm = its own re-read is irrelevant: flushed)
    w = jax.random.normal(jax.random.PRNGKey(7), (4096, K), jnp.bfloat16)
    for rows, bd, warps, stages in ((8, 512, 4, 4), (16, 512, 4, 4), (4, 1024, 4, 4), (8, 1024, 8, 2), (32, 256, 4, 4)):
        @jax.jit
        def g(fb, w):
            s = jnp.sum(fb, dtype=f32)
            return prefetch(w, rows=rows, bd=bd, warps=warps, stages=stages,
                            interpret=interpret)[0, 0] + s
        per = device_times(lambda: g(flush_buf, w), [()], reps=10)["kernels_us"]
        pre = sum(v for k, v in per.items() if "prefetch" in k)
        print(f"prefetch alone rows={rows} bd={bd} warps={warps} stages={stages}: {pre:.2f} us "
              f"({4096 * K * 2 / pre / 1e6:.2f} TB/s)", flush=True)
        res[f"prefetch_alone_{rows}_{bd}_{warps}_{stages}"] = pre
    out = os.environ.get("OUT", "/tmp")
    json.dump(res, open(f"{out}/explore_l2.json", "w"), indent=1)


if __name__ == "__main__":
    main()
