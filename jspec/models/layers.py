"""Building blocks shared by target models and drafters (Flax linen).

Weights keep Hugging Face's ``[out_features, in_features]`` layout: loading needs no
transpose, and at small batch ``x @ W.T`` through cuBLAS streams [out, in] weights fastest
on the H200 (../shared/reference/jax_gpu_tpu.md).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jspec.config import RopeConfig
from kernels_pallas.fused_linear import fused_linear, rms_norm  # noqa: F401  (rms_norm: re-exported)
from kernels_pallas.rope_kv_write import rope_halves, rope_tables

_zeros = nn.initializers.zeros
_ones = nn.initializers.ones
_normal = nn.initializers.normal(0.02)


class Linear(nn.Module):
    """y = [residual +] (prologue(x) @ W.T + b) with W: [out, in] (HF layout).

    The optional prologue (RMSNorm of x with ``norm_w``, or SwiGLU of a fused gate|up
    input) and residual add run inside the weight-streaming kernel when ``impl`` selects
    it (kernels_pallas/fused_linear.py: small batches on GPU); otherwise as XLA ops.
    Called without x it returns (weight, bias | None), for a kernel that fuses more.
    """

    features: int
    in_features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    impl: str = "reference"  # fused_linear impl: "reference" (XLA) | "gpu" | "interpret"

    @nn.compact
    def __call__(self, x=None, *, prologue="none", norm_w=None, eps=1e-6, residual=None, out_dtype=None,
                 sumsq=None, next_norm_w=None):
        w = self.param("weight", _normal, (self.features, self.in_features), self.dtype)
        b = self.param("bias", _zeros, (self.features,), self.dtype) if self.use_bias else None
        if x is None:
            return w, b
        return fused_linear(x, w, prologue=prologue, norm_w=norm_w, eps=eps, bias=b, residual=residual,
                            out_dtype=out_dtype, impl=self.impl, sumsq=sumsq, next_norm_w=next_norm_w)


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in float32, cast back, then scale. Called without x
    (``features`` set), it returns its weight, for a kernel that fuses the norm."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    features: int = 0  # 0: x.shape[-1]

    @nn.compact
    def __call__(self, x=None):
        w = self.param("weight", _ones, (self.features or x.shape[-1],), self.dtype)
        return w if x is None else rms_norm(x, w, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies (float32 [head_dim/2]), with Llama 3 scaling when configured."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE (HF convention). x: [B, Q, heads, D]; positions: i32[B, Q]. The
    maths is kernels_pallas/rope_kv_write.py's (the target's fused path), shared here."""
    return rope_halves(x, *rope_tables(positions, inv_freq))


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused into one [2I, H] matrix (one weight stream). With
    ``norm_w`` the input RMSNorm, with ``residual`` the residual add, happen in the
    projections (fused into their kernels when ``impl`` selects them). With ``normed``
    = (x * norm_w, partial sums of x^2) the norm was handed over by the previous projection
    (kernels_pallas/fused_linear.norm_handoff): gate_up reads x * norm_w, down scales by 1 / rms."""

    hidden: int
    intermediate: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    impl: str = "reference"

    @nn.compact
    def __call__(self, x, *, norm_w=None, eps=1e-6, residual=None, normed=None):
        gate_up = Linear(2 * self.intermediate, self.hidden, self.use_bias, self.dtype, self.impl, name="gate_up_proj")
        down = Linear(self.hidden, self.intermediate, self.use_bias, self.dtype, self.impl, name="down_proj")
        if normed is not None:
            x_scaled, sumsq = normed
            return down(gate_up(x_scaled), prologue="silu_mul", sumsq=sumsq, eps=eps, residual=residual)
        gu = gate_up(x, prologue="none" if norm_w is None else "rmsnorm", norm_w=norm_w, eps=eps)
        return down(gu, prologue="silu_mul", residual=residual)
