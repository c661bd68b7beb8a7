"""Experiment: does loading each x block one loop iteration ahead (fused_linear.stream_rows'
x_ahead, JSPEC_X_AHEAD) shorten the batch-1 GEMV kernels, and does computing the down
kernel's handed-over 1 / rms inside the loop (JSPEC_SCALE_IN_LOOP) hide its load?

Each variant re-traces the kernels (the switches are read at trace time) and is checked bit
for bit against the default variant; GPU time per call over 4 rotating weight sets, the
variants interleaved over --rounds rounds. Llama-3.1-8B shapes:
- o + residual + norm_out (fused_linear, [4096, 4096]);
- down + SwiGLU + residual + the handed-over norm (fused_linear, [4096, 14336]);
- qkv + RMSNorm + RoPE + KV write (qkv_rope_kv_write, [6144, 4096]).

    PYTHONPATH=.:scripts python scripts/experiments/explore_x_ahead.py     # GPU
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from gpu_trace import device_times
from kernels_pallas.fused_linear import fused_linear_gpu
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write_gpu
from kernels_pallas.rope_kv_write import rope_tables

f32, bf16 = jnp.float32, jnp.bfloat16
VARIANTS = {"base": {}, "x_ahead": {"JSPEC_X_AHEAD": "1"}, "scale_in_loop": {"JSPEC_SCALE_IN_LOOP": "1"},
            "both": {"JSPEC_X_AHEAD": "1", "JSPEC_SCALE_IN_LOOP": "1"}}


def weights(seed, shape, n=4):
    return [(0.02 * jax.random.normal(jax.random.PRNGKey(seed + i), shape)).astype(bf16) for i in range(n)]


def cases():
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    a, res = jax.random.normal(k[0], (1, 4096), bf16), jax.random.normal(k[1], (1, 4096), bf16)
    nw = (1 + 0.1 * jax.random.normal(k[2], (4096,))).astype(bf16)
    gu = jax.random.normal(k[3], (1, 28672), bf16)
    ss = jnp.abs(jax.random.normal(k[4], (1, 128), f32)) * 100.0
    P, S, KVH, D = 8, 16, 8, 128
    kp = jax.random.normal(k[5], (P, S, KVH, D), bf16)
    vp = jax.random.normal(k[6], (P, S, KVH, D), bf16)
    cos, sin = rope_tables(jnp.array([517]), 1.0 / (500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    slot = jnp.array([101], jnp.int32)
    return {
        "o + residual + norm_out": (lambda w: fused_linear_gpu(a, w, None, None, res, next_norm_w=nw),
                                    weights(10, (4096, 4096))),
        "down + SwiGLU + residual + sumsq": (
            lambda w: fused_linear_gpu(gu, w, None, None, res, prologue="silu_mul", eps=1e-5, sumsq=ss),
            weights(20, (4096, 14336))),
        "qkv + RoPE + KV write": (lambda w: qkv_rope_kv_write_gpu(a, w, nw, None, cos, sin, slot, kp, vp,
                                                                  num_heads=32, eps=1e-5),
                                  weights(30, (6144, 4096))),
    }


def run_variant(name, env):
    for key in ("JSPEC_X_AHEAD", "JSPEC_SCALE_IN_LOOP"):
        os.environ.pop(key, None)
    os.environ.update(env)
    jax.clear_caches()
    out = {}
    for case, (fn, ws) in cases().items():
        f = jax.jit(fn)
        first = jax.tree.leaves(f(ws[0]))
        t = device_times(f, [(w,) for w in ws], reps=20)
        out[case] = dict(us=t["busy_us"], outputs=[np.asarray(x.astype(f32)) for x in first])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows, base = [], None
    for r in range(args.rounds):
        for name, env in VARIANTS.items():
            res = run_variant(name, env)
            if base is None:
                base = res
            for case, v in res.items():
                same = all(np.array_equal(x, y) for x, y in zip(v["outputs"], base[case]["outputs"]))
                rows.append(dict(round=r, variant=name, case=case, us=v["us"], bitwise_equal_to_base=same))
                print(f"round {r} {name:14s} {case:34s} {v['us']:7.2f} us  equal to base: {same}", flush=True)
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "explore_x_ahead.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
