"""Experiment (not adopted): fused_linear's kernel on 2-16 rows of x (batch-2-16 decode,
batch-1 verification of up to 16 tokens) against XLA's unfused ops.

Why: above one row every projection runs through XLA with its RMSNorm, SwiGLU and residual
fusions as kernels of their own; at one row the fused kernels saved ~0.5 ms per step. The
tensor-core form already carries h in row 0 of a 16-row operand, so rows 1-15 would ride
along for the same weight bytes.

How: commit "Experiment: fused_linear on 2-16 rows" (kernels_pallas/fused_linear.py,
_stream_rows_multi / _kernel_rows; off unless JSPEC_KERNEL_ROWS=16): each operand row is a
row of x (padding rows repeat the last one and store it again), the epilogue works on
[16, block_f] tiles. JSPEC_SS picks how the RMSNorm's sum of x^2 accumulates (carry: an f32
[16, block_d] carry; reduce: a per-block row sum; mma: x x^T on the tensor cores, its
diagonal; none: not at all, a timing floor with wrong outputs); JSPEC_X_GATHER=1 gathers x
rows by index even when no row is padding. CASES picks shapes (qkv, qkvnone, o, down).

    JSPEC_KERNEL_ROWS=16 [JSPEC_SS=mma] [CASES=qkv] PYTHONPATH=.:scripts \
        python scripts/experiments/explore_rows.py 8,16

Outcome on the H200 (2026-11-22, jax 0.11.2, profiler GPU time over 4 rotating weights;
docs/benchmarks.md, fourteenth session; raw docs/bench/2026-11-22_v14_rows_*.json): the
prologues are recomputed by every program, so their cost grows with the rows. At 8 rows,
qkv + RMSNorm 30.3 us (XLA 18.0), down + SwiGLU 270-5400 us at any tiling (register
spills; XLA 33.2), o + residual 12.4 (XLA 11.3). The x^2 sum is qkv's whole extra cost:
without it 15.7 us; on the tensor cores (JSPEC_SS=mma) 17.3 at 8 rows and 16.7 at 16 (XLA
19.4). Gathered and block loads of x time the same. In the engine at batch 8 and 16 the
kernels did not run: down's default tiles (6 stages) ask for 336 KB of shared memory once
its [16, 512] x tiles are pipelined too (raw ..._v14_rows_engine.log).
"""
import json
import os
import sys

import jax
import jax.numpy as jnp

from kernels_pallas.fused_linear import fused_linear_gpu, ref_fused_linear
from gpu_trace import device_times
from bench_linear import rel_err

SHAPES = [("qkv", 6144, 4096, "rmsnorm", False), ("qkvnone", 6144, 4096, "none", True),
          ("o", 4096, 4096, "none", True), ("down", 4096, 14336, "silu_mul", True)]
CASES = [c for c in SHAPES if c[0] in os.environ.get("CASES", "qkv,o,down").split(",")]
TILES = {  # None: default_mma_blocks
    "qkv": [None, (32, 256, 4, 4, True), (32, 256, 4, 6, True), (64, 256, 8, 4, True), (64, 128, 4, 6, True),
            (32, 512, 4, 3, True), (64, 256, 4, 3, True)],
    "qkvnone": [None, (64, 256, 4, 3, True), (32, 256, 4, 6, True)],
    "o": [None, (32, 256, 4, 4, True), (32, 128, 4, 8, True), (32, 512, 4, 3, True), (64, 256, 4, 4, True)],
    "down": [(32, 512, 4, 3, True), (32, 256, 4, 6, True), (32, 512, 4, 2, True), (64, 256, 4, 4, True),
             (32, 1024, 4, 2, True)],
}
out = []
for name, F, K, pro, res in CASES:
    for M in [int(m) for m in sys.argv[1].split(",")]:
        ks = jax.random.split(jax.random.PRNGKey(F + M), 8)
        kin = 2 * K if pro == "silu_mul" else K
        x = jax.random.normal(ks[0], (M, kin), jnp.float32).astype(jnp.bfloat16)
        ws = [(0.02 * jax.random.normal(ks[1 + i], (F, K), jnp.float32)).astype(jnp.bfloat16) for i in range(4)]
        nw = (1 + 0.1 * jax.random.normal(ks[5], (K,))).astype(jnp.bfloat16) if pro == "rmsnorm" else None
        r = jax.random.normal(ks[6], (M, F)).astype(jnp.bfloat16) if res else None
        ref = jax.jit(lambda x, w: ref_fused_linear(x, w, prologue=pro, norm_w=nw, eps=1e-5, residual=r))
        t_x = device_times(ref, [(x, w) for w in ws], reps=10)["busy_us"]
        want = ref(x, ws[0])
        for b in TILES[name]:
            fn = jax.jit(lambda x, w, b=b: fused_linear_gpu(x, w, nw, None, r, prologue=pro, eps=1e-5, blocks=b))
            try:
                err = rel_err(fn(x, ws[0]), want)
                t = device_times(fn, [(x, w) for w in ws], reps=10)["busy_us"]
            except Exception as e:
                err, t = str(e)[:80], None
            row = dict(name=name, M=M, blocks=b, us=t, xla_us=t_x, err=err, gather=os.environ.get("JSPEC_X_GATHER"))
            out.append(row)
            print(row, flush=True)
with open(os.path.join(os.environ.get("OUT", "."), f"rows_{os.environ.get('TAG','x')}.json"), "w") as f:
    json.dump(out, f)
