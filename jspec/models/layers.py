"""Building blocks shared by target models and drafters (Flax linen).

Weights keep Hugging Face's ``[out_features, in_features]`` layout: loading needs no
transpose, and at small batch ``x @ W.T`` through cuBLAS streams [out, in] weights fastest
on the H200 (../shared/reference/jax_gpu_tpu.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jspec.config import RopeConfig

_zeros = nn.initializers.zeros
_ones = nn.initializers.ones
_normal = nn.initializers.normal(0.02)


class Linear(nn.Module):
    """y = x @ W.T + b with W: [out, in] (HF layout)."""

    features: int
    in_features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., in] -> [..., out]
        w = self.param("weight", _normal, (self.features, self.in_features), self.dtype)
        y = jnp.einsum("...d,fd->...f", x.astype(w.dtype), w)
        if self.use_bias:
            y = y + self.param("bias", _zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in float32, cast back, then scale."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", _ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, w, self.eps)


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


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
    """Rotate-half RoPE (HF convention). x: [B, Q, heads, D]; positions: i32[B, Q]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, Q, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, Q, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos + rot.astype(jnp.float32) * sin).astype(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused into one [2I, H] matrix (one weight stream)."""

    hidden: int
    intermediate: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        gu = Linear(2 * self.intermediate, self.hidden, self.use_bias, self.dtype, name="gate_up_proj")(x)
        g, u = jnp.split(gu, 2, axis=-1)
        return Linear(self.hidden, self.intermediate, self.use_bias, self.dtype, name="down_proj")(nn.silu(g) * u)
