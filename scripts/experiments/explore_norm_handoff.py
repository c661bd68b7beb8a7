"""GPU check of the RMSNorm hand-over at Llama-3.1-8B shapes (compiled kernels, not the
interpreter): o_proj's kernel with next_norm_w writes the same h as without it and per-program
sums of h^2 that add up to sum(h^2); down_proj's kernel with sumsq == its reference and ~= the
unfused rms_norm -> gate_up -> SwiGLU -> down (relative to the MLP's delta).

    PYTHONPATH=.:scripts python scripts/experiments/explore_norm_handoff.py     # GPU
"""
import jax, jax.numpy as jnp
from kernels_pallas.fused_linear import fused_linear, ref_fused_linear
f32 = jnp.float32
k = jax.random.split(jax.random.PRNGKey(0), 6)
bf = jnp.bfloat16
a = jax.random.normal(k[0], (1, 1, 4096), bf); res = jax.random.normal(k[1], (1, 1, 4096), bf)
wo = (0.02 * jax.random.normal(k[2], (4096, 4096))).astype(bf); wgu = (0.02 * jax.random.normal(k[3], (28672, 4096))).astype(bf)
wd = (0.02 * jax.random.normal(k[4], (4096, 14336))).astype(bf); nw = (1 + 0.1 * jax.random.normal(k[5], (4096,))).astype(bf)
h, hn, ss = fused_linear(a, wo, residual=res, next_norm_w=nw, impl="gpu")
h0 = fused_linear(a, wo, residual=res, impl="gpu")
print("h == plain kernel:", bool(jnp.all(h == h0)), "ss", ss.shape, float(ss.sum()), float(jnp.sum(h.astype(f32) ** 2)))
gu = jnp.einsum("...d,fd->...f", hn, wgu)
out = fused_linear(gu, wd, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5, impl="gpu")
ref = ref_fused_linear(gu, wd, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5)
un = ref_fused_linear(ref_fused_linear(h, wgu, prologue="rmsnorm", norm_w=nw, eps=1e-5), wd, prologue="silu_mul", residual=h)
d = lambda x, y: float(jnp.linalg.norm(x.astype(f32) - y.astype(f32)) / jnp.linalg.norm(y.astype(f32) - h.astype(f32)))
print("down kernel vs its reference (rel to the MLP delta):", d(out, ref), " vs the unfused MLP:", d(out, un))

# Timing (profiler GPU time per call, 4 rotating weight sets): each kernel with and without
# its hand-over input/output, and XLA's gate_up with and without the norm in front.
from gpu_trace import device_times  # noqa: E402

ks = jax.random.split(jax.random.PRNGKey(1), 8)
wos = [(0.02 * jax.random.normal(k_, (4096, 4096))).astype(bf) for k_ in ks[:4]]
wds = [(0.02 * jax.random.normal(k_, (4096, 14336))).astype(bf) for k_ in ks[4:]]
x2, r2 = a.reshape(1, -1), res.reshape(1, -1)
gu2, h2, ss2 = gu.reshape(1, -1), h.reshape(1, -1), ss.reshape(1, -1)
from kernels_pallas.fused_linear import fused_linear_gpu  # noqa: E402
cases = {
    "o + residual": (lambda w: fused_linear_gpu(x2, w, None, None, r2), wos),
    "o + residual + norm_out": (lambda w: fused_linear_gpu(x2, w, None, None, r2, next_norm_w=nw), wos),
    "down + SwiGLU + residual": (lambda w: fused_linear_gpu(gu2, w, None, None, h2, prologue="silu_mul"), wds),
    "down + SwiGLU + residual + sumsq": (
        lambda w: fused_linear_gpu(gu2, w, None, None, h2, prologue="silu_mul", eps=1e-5, sumsq=ss2), wds),
}
for name, (fn, ws) in cases.items():
    f = jax.jit(fn)
    t = device_times(f, [(w,) for w in ws], reps=20)
    print(f"{name}: {t['busy_us']:.2f} us", flush=True)
