"""Experiment: fewer, wider K blocks for the batch-1 GEMV kernels' tensor-core form.

Each K block costs the x path a fixed share (explore_prologue_cost.py: a reduction per
block cost qkv 0.5-0.65 us per call), and the tile sweeps so far (scripts/bench_linear.py
--sweep) tried the MMA form only at 256- and 512-wide blocks. This times the engine's
three kernels at their default tiles and at 1024-wide (and 128-wide) blocks with the
stages shared memory allows, each checked against the default tiling's output:
- down [4096, 14336] + SwiGLU + residual + the handed-over 1/rms (fused_linear);
- o [4096, 4096] + residual + the hand-over's outputs (fused_linear);
- qkv + RMSNorm + RoPE + KV write ([6144, 4096], qkv_rope_kv_write).
GPU time per call over 4 rotating weight sets, two rounds.

Outcome on the H200 (2026-11-22, jax 0.11.2; docs/benchmarks.md, thirteenth session; raw
docs/bench/2026-11-22_v13_wide_blocks.json): the defaults stay. down at 32 x 1024, 3 stages
33.36 / 33.47 us against 33.60 / 33.66 at the default 32 x 512, 6 stages (0.2 us, no more
shared memory than the default's); o and qkv are fastest at their defaults. What a tiling
keeps in flight decides more than its width: 32 x 1024 with 2 stages 46.8 us (down), 32 x
128 with 8 stages 28.6 (o) and 35.8 (qkv).

    PYTHONPATH=.:scripts python scripts/experiments/explore_wide_blocks.py     # GPU
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from explore_prologue_cost import layer_inputs, weights
from gpu_trace import time_tilings
from kernels_pallas.fused_linear import default_mma_blocks, fused_linear_gpu
from kernels_pallas.qkv_rope_kv_write import kernel_blocks, qkv_rope_kv_write_gpu

f32, bf16 = jnp.float32, jnp.bfloat16


def main():
    i = layer_inputs()
    a, res, nw, gu, ss = i["a"], i["res"], i["nw"], i["gu"], i["ss"]
    cos, sin, slot, kp, vp = i["cos"], i["sin"], i["slot"], i["kp"], i["vp"]
    D = kp.shape[-1]
    cases = {
        "down": (lambda b: jax.jit(lambda w: fused_linear_gpu(gu, w, None, None, res, prologue="silu_mul", eps=1e-5,
                                                              sumsq=ss, blocks=b)),
                 weights(30, (4096, 14336)), default_mma_blocks(4096, 14336, bf16),
                 [(32, 1024, 4, 2, True), (32, 1024, 4, 3, True), (32, 1024, 8, 3, True), (32, 512, 4, 4, True),
                  (32, 256, 4, 8, True)]),
        "o": (lambda b: jax.jit(lambda w: fused_linear_gpu(a, w, None, None, res, next_norm_w=nw, blocks=b)),
              weights(20, (4096, 4096)), default_mma_blocks(4096, 4096, bf16),
              [(32, 512, 4, 3, True), (32, 512, 4, 4, True), (32, 1024, 4, 2, True), (32, 128, 4, 8, True)]),
        "qkv + RoPE + KV write": (
            lambda b: jax.jit(lambda w: qkv_rope_kv_write_gpu(a, w, nw, None, cos, sin, slot, kp, vp, num_heads=32,
                                                              eps=1e-5, blocks=b)),
            weights(10, (6144, 4096)), kernel_blocks(6144, 4096, D, bf16),
            [(32, 512, 4, 3, True), (32, 512, 4, 2, True), (32, 128, 4, 8, True), (32, 256, 4, 3, True)]),
    }
    out = {}
    for name, (make, ws, default, others) in cases.items():
        want = [np.asarray(x.astype(f32)) for x in jax.tree.leaves(make(default)(ws[0]))]

        def check(fn):
            got = [np.asarray(x.astype(f32)) for x in jax.tree.leaves(fn(ws[0]))]
            return max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12)) for g, w in zip(got, want))

        rows = []
        for rnd in range(2):
            for tiling, us, err in time_tilings(make, [default] + others, [(w,) for w in ws], reps=20, check=check):
                rows.append(dict(round=rnd, tiling=list(tiling), default=tiling == default, us=us, err_vs_default=err))
                print(f"round {rnd} {name:22s} {tiling}{' (default)' if tiling == default else ''}: "
                      f"{us if isinstance(us, str) else f'{us:.2f} us'}  vs default {err}", flush=True)
        out[name] = rows
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "explore_wide_blocks.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, cases=out), f, indent=1)


if __name__ == "__main__":
    main()
