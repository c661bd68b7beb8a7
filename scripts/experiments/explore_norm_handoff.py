"""The RMSNorm hand-over (kernels_pallas/fused_linear.norm_handoff) at Llama-3.1-8B shapes,
compiled kernels on the GPU:

- check: o_proj's kernel with next_norm_w writes the same h as without it, and per-program
  sums of h^2 that add up to sum(h^2); down_proj's kernel with sumsq == its reference and
  ~= the unfused rms_norm -> gate_up -> SwiGLU -> down (relative to the MLP's delta);
- time: each kernel with and without its hand-over output / input (profiler GPU time per
  call over 4 rotating weight sets).

Outcome on the H200 (2026-11-22, jax 0.11.2; docs/benchmarks.md, twelfth session): h bit
for bit, down 2.2e-4 from its reference; o 10.93 -> 11.27 us, down 32.47 -> 33.66 us.

    PYTHONPATH=.:scripts python scripts/experiments/explore_norm_handoff.py     # GPU
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gpu_trace import device_times
from kernels_pallas.fused_linear import fused_linear, fused_linear_gpu, ref_fused_linear

f32, bf16 = jnp.float32, jnp.bfloat16


def weight(key, shape):
    return (0.02 * jax.random.normal(key, shape)).astype(bf16)


def main():
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    a, res = jax.random.normal(k[0], (1, 1, 4096), bf16), jax.random.normal(k[1], (1, 1, 4096), bf16)
    wo, wgu, wd = weight(k[2], (4096, 4096)), weight(k[3], (28672, 4096)), weight(k[4], (4096, 14336))
    nw = (1 + 0.1 * jax.random.normal(k[5], (4096,))).astype(bf16)

    h, hn, ss = fused_linear(a, wo, residual=res, next_norm_w=nw, impl="gpu")
    h0 = fused_linear(a, wo, residual=res, impl="gpu")
    print("h == plain kernel:", bool(jnp.all(h == h0)), "ss", ss.shape, float(ss.sum()),
          float(jnp.sum(h.astype(f32) ** 2)))
    gu = jnp.einsum("...d,fd->...f", hn, wgu)
    out = fused_linear(gu, wd, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5, impl="gpu")
    ref = ref_fused_linear(gu, wd, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5)
    unfused = ref_fused_linear(ref_fused_linear(h, wgu, prologue="rmsnorm", norm_w=nw, eps=1e-5), wd,
                               prologue="silu_mul", residual=h)

    def rel(x, y):  # relative to the MLP's delta y - h
        return float(jnp.linalg.norm(x.astype(f32) - y.astype(f32)) / jnp.linalg.norm(y.astype(f32) - h.astype(f32)))

    print("down kernel vs its reference (rel to the MLP delta):", rel(out, ref), " vs the unfused MLP:",
          rel(out, unfused))

    ks = jax.random.split(jax.random.PRNGKey(1), 8)
    wos = [weight(k_, (4096, 4096)) for k_ in ks[:4]]
    wds = [weight(k_, (4096, 14336)) for k_ in ks[4:]]
    x2, r2, gu2, h2, ss2 = (v.reshape(1, -1) for v in (a, res, gu, h, ss))
    cases = {
        "o + residual": (lambda w: fused_linear_gpu(x2, w, None, None, r2), wos),
        "o + residual + norm_out": (lambda w: fused_linear_gpu(x2, w, None, None, r2, next_norm_w=nw), wos),
        "down + SwiGLU + residual": (lambda w: fused_linear_gpu(gu2, w, None, None, h2, prologue="silu_mul"), wds),
        "down + SwiGLU + residual + sumsq": (
            lambda w: fused_linear_gpu(gu2, w, None, None, h2, prologue="silu_mul", eps=1e-5, sumsq=ss2), wds),
    }
    for name, (fn, ws) in cases.items():
        t = device_times(jax.jit(fn), [(w,) for w in ws], reps=20)
        print(f"{name}: {t['busy_us']:.2f} us", flush=True)


if __name__ == "__main__":
    main()
