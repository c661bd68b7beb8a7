"""Building blocks shared by target models and drafters (Flax linen).

Weights keep Hugging Face's ``[out_features, in_features]`` layout: loading needs no
transpose, and at small batch ``x @ W.T`` through cuBLAS streams [out, in] weights fastest
on the H200 (../shared/reference/jax_gpu_tpu.md). The CPU plan holds them [in, out]
(ops.KernelPlan.in_out_weights): every weight is declared through ops.weight_shape.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jspec import mxfp4, ops
from jspec.config import RopeConfig
from jspec.ops import KernelPlan
from kernels_pallas.fused_linear import rms_norm
from kernels_pallas.rope_kv_write import rope_halves, rope_tables

_zeros = nn.initializers.zeros
_ones = nn.initializers.ones
_normal = nn.initializers.normal(0.02)


def param(module: nn.Module, name: str, init, shape, dtype):
    """``module.param(name, init, shape, dtype)``, without Flax's check when the parameter exists
    (an apply): Flax traces ``init`` under jax.eval_shape for every parameter of every apply to
    compare shapes, ~45% of tracing an 8B step (CPU, 2026-11-30), which warmup repeats for each
    step program. jspec's loaders check every tensor's shape against its spec when they load it."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, init, shape, dtype)


class Linear(nn.Module):
    """y = x @ W.T + b with W: [out, in] (HF layout; [in, out] under the CPU plan). An op
    that fuses more than the projection (ops.qkv_rope_write, ops.mlp) reads ``weight`` and
    ``bias`` directly."""

    features: int
    in_features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()

    def setup(self):
        self.weight = param(self, "weight", _normal, ops.weight_shape(self.plan, self.features, self.in_features),
                            self.dtype)
        self.bias = param(self, "bias", _zeros, (self.features,), self.dtype) if self.use_bias else None

    def __call__(self, x, *, residual=None):  # x: f[..., in] or ops.Normed -> [..., out]
        return ops.linear(self.plan, x, self.weight, self.bias, residual=residual)


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in float32, cast back, then scale. Weight [features]
    (0: the input's width)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    features: int = 0

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, param(self, "weight", _ones, (self.features or x.shape[-1],), self.dtype), self.eps)


class NormWeight(nn.Module):
    """An RMSNorm's weight [features] (same parameter tree as RMSNorm) for a norm that an op
    applies: one the next projection applies (ops.Normed), Qwen3's per-head q/k norms."""

    features: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.weight = param(self, "weight", _ones, (self.features,), self.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies (float32 [head_dim/2]), with Llama 3 or YaRN scaling when configured."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv)
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


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv: np.ndarray) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): the original frequencies for the
    dimensions that turn more than beta_fast times over original_max_position_embeddings,
    divided by ``factor`` for those under beta_slow, a linear ramp between."""
    def dim_of(rotations):  # the dimension whose wavelength fits ``rotations`` times
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
    extrapolate = 1 - ramp  # 1: the original frequency
    return (inv / rope.factor * ramp + inv * extrapolate).astype(np.float32)


def rope_for(rope: RopeConfig, head_dim: int, positions):
    """(cos, sin) f32[..., D/2] at ``positions`` (i32[...]): the tables every attention of a
    model rotates q and k with; YaRN multiplies both by its attention factor (q . k by its
    square), as transformers' rotary embedding does."""
    cos, sin = rope_tables(positions, rope_inv_freq(rope, head_dim))
    if rope.rope_type == "yarn" and rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE (HF convention). x: [B, Q, heads, D]; positions: i32[B, Q]. The
    maths is kernels_pallas/rope_kv_write.py's (the target's fused path), shared here."""
    return rope_halves(x, *rope_tables(positions, inv_freq))


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused into one [2I, H] matrix (one weight stream):
    [residual +] down(silu(g) * u). x may be an ops.Normed: the norm before the MLP, applied
    by the projections (ops.mlp)."""

    hidden: int
    intermediate: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()

    def setup(self):
        self.gate_up_proj = Linear(2 * self.intermediate, self.hidden, self.use_bias, self.dtype, self.plan)
        self.down_proj = Linear(self.hidden, self.intermediate, self.use_bias, self.dtype, self.plan)

    def __call__(self, x, *, residual=None, next_norm=None):  # x: f[..., H] or ops.Normed -> [..., H] or Normed
        g, d = self.gate_up_proj, self.down_proj
        return ops.mlp(self.plan, x, g.weight, g.bias, d.weight, d.bias, residual=residual, next_norm=next_norm)


class MoE(nn.Module):
    """Qwen3-MoE's and gpt-oss's sparse MLP (ops.moe): a router ``gate`` [E, H] (a Linear) and
    the experts' stacked weights ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (HF [out, in]
    per expert, in every plan; FP8 or MXFP4 leaves of those shapes where the checkpoint is
    quantized). x may be an ops.Normed (the norm before the MLP)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()
    # gpt-oss: the router's bias (gate/bias [E]) and the experts' (gate_up_bias [E, 2I],
    # down_bias [E, H]); swiglu_limit > 0: its clamped SwiGLU (ops.moe)
    use_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    mxfp4: bool = False  # the experts' weights kept packed (jspec.mxfp4.Mxfp4Weight): gpt-oss as shipped

    def setup(self):
        E, H, I = self.num_experts, self.hidden, self.intermediate
        self.gate = Linear(E, H, self.use_bias, self.dtype, self.plan)
        init = mxfp4.declared if self.mxfp4 else _normal
        self.gate_up = param(self, "gate_up", init, (E, 2 * I, H), self.dtype)
        self.down = param(self, "down", init, (E, H, I), self.dtype)
        if self.use_bias:
            self.gate_up_bias = param(self, "gate_up_bias", _zeros, (E, 2 * I), self.dtype)
            self.down_bias = param(self, "down_bias", _zeros, (E, H), self.dtype)

    def __call__(self, x, *, residual=None, next_norm=None):  # x: f[..., H] or ops.Normed -> [..., H]
        """next_norm: ignored (GatedMLP's signature): the output is never handed over."""
        biases = dict(b_router=self.gate.bias, b_gate_up=self.gate_up_bias, b_down=self.down_bias) \
            if self.use_bias else {}
        return ops.moe(self.plan, x, self.gate.weight, self.gate_up, self.down, top_k=self.top_k,
                       norm_topk_prob=self.norm_topk_prob, residual=residual, swiglu_limit=self.swiglu_limit,
                       swiglu_alpha=self.swiglu_alpha, **biases)
