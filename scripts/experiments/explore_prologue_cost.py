"""What do fused_linear's prologues and epilogues cost per call? Llama-3.1-8B shapes, GPU
time per call over 4 rotating weight sets, two rounds:
- qkv [6144, 4096]: fused_linear with the RMSNorm prologue, bare, and the
  qkv + RoPE + KV-write kernel (its time includes copies of the small undonated caches);
- o [4096, 4096]: + residual + the norm hand-over's outputs / + residual / bare;
- down [4096, 14336]: SwiGLU + residual + the handed-over 1/rms / SwiGLU + residual /
  pre-activated x + residual / bare.

Outcome on the H200 (2026-11-22, jax 0.11.2; docs/benchmarks.md, thirteenth session; raw
docs/bench/2026-11-22_v13_prologue_cost.json): the RMSNorm prologue cost the qkv projection
0.8 us over bare (15.6 vs 14.8) while it reduced sum(x^2) once per K block; accumulated
elementwise and reduced once after the loop (a scratch switch, JSPEC_SS_VEC, in that run)
it was 14.9-15.0, and the qkv + RoPE + KV-write kernel 18.2-18.3 against 18.7-18.8. That is
fused_linear.stream_rows' form now. down: bare 31.1 us, + residual 31.3-31.5, + SwiGLU
32.1-32.4, + the handed-over 1/rms 33.2-33.3. o: bare 11.2, + residual 11.2-11.3, + the
hand-over's outputs 11.5-11.7.

    PYTHONPATH=.:scripts python scripts/experiments/explore_prologue_cost.py     # GPU
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench_linear import rel_err
from gpu_trace import device_times
from kernels_pallas.fused_linear import fused_linear_gpu, ref_fused_linear
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write_gpu, ref_qkv_rope_kv_write
from kernels_pallas.rope_kv_write import rope_tables

f32, bf16 = jnp.float32, jnp.bfloat16


def weights(seed, shape, n=4):
    """n random bf16 weights of one shape (rotated through the timed calls, so none is read from L2)."""
    return [(0.02 * jax.random.normal(jax.random.PRNGKey(seed + i), shape)).astype(bf16) for i in range(n)]


def layer_inputs():
    """One token's activations for a Llama-3.1-8B layer's kernels (also explore_wide_blocks.py):
    a / res [1, 4096] (the attention output and the residual), nw [4096] (a norm weight), gu
    [1, 28672] (gate|up), act [1, 14336] (pre-activated), ss f32[1, 128] (o_proj's partial sums
    of h^2), a small KV cache kp / vp [8, 16, 8, 128] with slot 101, and RoPE tables at 517."""
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    D = 128
    cos, sin = rope_tables(jnp.array([517]), 1.0 / (500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    return dict(a=jax.random.normal(k[0], (1, 4096), bf16), res=jax.random.normal(k[1], (1, 4096), bf16),
                nw=(1 + 0.1 * jax.random.normal(k[2], (4096,))).astype(bf16),
                gu=jax.random.normal(k[3], (1, 28672), bf16), act=jax.random.normal(k[7], (1, 14336), bf16),
                ss=jnp.abs(jax.random.normal(k[4], (1, 128), f32)) * 100.0,
                kp=jax.random.normal(k[5], (8, 16, 8, D), bf16), vp=jax.random.normal(k[6], (8, 16, 8, D), bf16),
                cos=cos, sin=sin, slot=jnp.array([101], jnp.int32))


def cases():
    i = layer_inputs()
    a, res, nw, gu, act, ss = i["a"], i["res"], i["nw"], i["gu"], i["act"], i["ss"]
    cos, sin, slot, kp, vp = i["cos"], i["sin"], i["slot"], i["kp"], i["vp"]
    wq, wo, wd = weights(10, (6144, 4096)), weights(20, (4096, 4096)), weights(30, (4096, 14336))

    def qkv_ref(w):
        return ref_qkv_rope_kv_write(a, w, nw, None, cos, sin, slot, kp, vp, num_heads=32, eps=1e-5)

    return {
        "qkv rmsnorm": (lambda w: fused_linear_gpu(a, w, nw, prologue="rmsnorm", eps=1e-5), wq,
                        lambda w: ref_fused_linear(a, w, prologue="rmsnorm", norm_w=nw, eps=1e-5)),
        "qkv bare": (lambda w: fused_linear_gpu(a, w), wq, None),
        "qkv + RoPE + KV write": (lambda w: qkv_rope_kv_write_gpu(a, w, nw, None, cos, sin, slot, kp, vp,
                                                                  num_heads=32, eps=1e-5), wq, qkv_ref),
        "o + residual + norm_out": (lambda w: fused_linear_gpu(a, w, None, None, res, next_norm_w=nw), wo, None),
        "o + residual": (lambda w: fused_linear_gpu(a, w, None, None, res), wo, None),
        "o bare": (lambda w: fused_linear_gpu(a, w), wo, None),
        "down SwiGLU + residual + sumsq": (
            lambda w: fused_linear_gpu(gu, w, None, None, res, prologue="silu_mul", eps=1e-5, sumsq=ss), wd, None),
        "down SwiGLU + residual": (lambda w: fused_linear_gpu(gu, w, None, None, res, prologue="silu_mul"), wd, None),
        "down + residual": (lambda w: fused_linear_gpu(act, w, None, None, res), wd, None),
        "down bare": (lambda w: fused_linear_gpu(act, w), wd, None),
    }


def main():
    rows = []
    for rnd in range(2):
        for name, (fn, ws, ref) in cases().items():
            f = jax.jit(fn)
            err = None
            if ref is not None:
                err = max(rel_err(x, y) for x, y in zip(jax.tree.leaves(f(ws[0])), jax.tree.leaves(ref(ws[0]))))
            us = device_times(f, [(w,) for w in ws], reps=20)["busy_us"]
            rows.append(dict(round=rnd, case=name, us=us, rel_err=err))
            print(f"round {rnd} {name:32s} {us:7.2f} us  rel err {err}", flush=True)
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "explore_prologue_cost.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
