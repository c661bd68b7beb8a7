"""Dense (cache-free) forwards for training, over the parameter trees jspec serves.

Every function reads the same tree the inference modules read (jspec/models/transformer.py
for targets and ordinary decoder layers, jspec/drafters/{eagle3,dflash}.py for drafters,
fused qkv and gate|up included), so a trained tree is saved through the checkpoint specs
(target_param_spec, drafter_param_spec) and served unchanged. Attention is one masked
``jax.nn.dot_product_attention`` over whole sequences: training masks (causal, EAGLE3's
training-time-test diagonals, PEagle's rollouts, DFlash's anchored blocks) are boolean
[B | 1, T, S] arrays built by the callers. The norm and RoPE maths are jspec's own
(models.layers), which is what makes trained logits equal served logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.layers import rms_norm, rope_for
from kernels_pallas.fused_linear import silu_mul
from kernels_pallas.rope_kv_write import rope_halves


def linear(x, w):  # x: [..., in], w: [out, in] (HF layout) -> [..., out]
    return jnp.einsum("...i,oi->...o", x, w)


def cast_tree(tree, dtype):
    """Floating leaves to ``dtype`` (the compute dtype); integer leaves unchanged."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def rope(c: ModelConfig, positions):  # positions: i32[B, T] -> (cos, sin) f32[B, T, D/2]
    return rope_for(c.rope, c.head_dim, positions)


def attention(q, k, v, mask):
    """q: [B, T, Hq, D], k/v: [B, S, Hkv, D] (GQA: Hkv divides Hq), mask: bool[B | 1, T, S]
    (True = may attend; every row needs one True) -> [B, T, Hq * D]."""
    B, T, H, D = q.shape
    o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=D**-0.5)
    return o.reshape(B, T, H * D)


def causal_mask(T: int):  # -> bool[1, T, T]
    i = jnp.arange(T)
    return (i[None, :] <= i[:, None])[None]


def qkv_heads(c: ModelConfig, qkv, attn_p, cos, sin):
    """Split a fused qkv projection [B, T, (Hq + 2 Hkv) D] into roped q, k and v heads."""
    B, T, _ = qkv.shape
    q = qkv[..., : c.q_size].reshape(B, T, c.num_heads, c.head_dim)
    k = qkv[..., c.q_size : c.q_size + c.kv_size].reshape(B, T, c.num_kv_heads, c.head_dim)
    v = qkv[..., c.q_size + c.kv_size :].reshape(B, T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, attn_p["q_norm"]["weight"], c.rms_norm_eps)
        k = rms_norm(k, attn_p["k_norm"]["weight"], c.rms_norm_eps)
    return rope_halves(q, cos, sin), rope_halves(k, cos, sin), v


def mlp(p, x):  # p: {gate_up_proj, down_proj}
    return linear(silu_mul(linear(x, p["gate_up_proj"]["weight"])), p["down_proj"]["weight"])


def self_attention(c: ModelConfig, attn_p, x, cos, sin, mask, past=()):
    """Attention of x's rows over [past K/V..., x's own K/V] -> (o_proj output, (k, v)).

    past: (k, v) pairs [B, S_i, Hkv, D] (already roped) from earlier passes, e.g. EAGLE3's
    training-time-test steps; mask: bool[B | 1, T, sum(S_i) + T] in the same key order.
    """
    q, k, v = qkv_heads(c, linear(x, attn_p["qkv_proj"]["weight"]), attn_p, cos, sin)
    ks = jnp.concatenate([pk for pk, _ in past] + [k], axis=1)
    vs = jnp.concatenate([pv for _, pv in past] + [v], axis=1)
    return linear(attention(q, ks, vs, mask), attn_p["o_proj"]["weight"]), (k, v)


def decoder_layer(c: ModelConfig, p, x, cos, sin, mask, past=()):
    """Pre-norm Llama / Qwen3 layer (jspec.models.transformer.DecoderLayer's tree)
    -> (x, this pass's (k, v))."""
    h = rms_norm(x, p["input_layernorm"]["weight"], c.rms_norm_eps)
    a, kv = self_attention(c, p["attn"], h, cos, sin, mask, past)
    x = x + a
    return x + mlp(p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], c.rms_norm_eps)), kv


def check_trainable(c: ModelConfig):
    """The training forwards carry no projection biases (the family has none)."""
    if c.attention_bias or c.mlp_bias:
        raise ValueError("jspec.train builds models without attention / MLP biases")
