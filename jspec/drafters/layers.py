"""Decoder pieces specific to drafters (Flax linen), over the drafter's own paged KV cache.

Ordinary drafter layers reuse ``jspec.models.transformer.DecoderLayer`` with the drafter's
``DrafterConfig.layer_config()``; only the EAGLE3 first layer (2H attention input) and the
DFlash layer (context K/V injected into the cache) differ.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.config import ModelConfig
from jspec.kv_cache import AttentionMetadata
from jspec.models.layers import GatedMLP, Linear, NormWeight, RMSNorm, rope_for
from jspec.models.transformer import Attention
from jspec.ops import KernelPlan
from kernels_pallas.fused_linear import rms_norm
from kernels_pallas.paged_attention import write_kv
from kernels_pallas.rope_kv_write import rope_halves


class Eagle3FirstLayer(nn.Module):
    """EAGLE3 layer 0: attention over concat(input_layernorm(embeds), hidden_norm(h)), then a
    target-style MLP. As in DecoderLayer, o_proj adds the residual and hands the
    post-attention norm to the MLP (ops.linear_then_norm), whose down_proj may hand the next
    layer's input norm over (``next_norm``)."""

    cfg: ModelConfig
    norm_before_residual: bool
    dtype: jnp.dtype
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = NormWeight(c.hidden_size, self.dtype)
        self.attn = Attention(c, self.dtype, self.plan, in_features=2 * c.hidden_size)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, self.plan)

    def __call__(self, embeds, h, meta, k_pages, v_pages, next_norm=None):
        """embeds, h: [B, Q, H]; next_norm: the next layer's input-norm weight [H] | None.
        -> (output [B, Q, H] or ops.Normed with next_norm handed over, k_pages, v_pages)"""
        c = self.cfg
        hn = self.hidden_norm(h)
        x = jnp.concatenate([self.input_layernorm(embeds), hn], axis=-1)  # embeddings first
        residual = hn if self.norm_before_residual else h
        h_normed, k_pages, v_pages = self.attn(x, meta, k_pages, v_pages, residual=residual,
                                               out_norm=self.post_attention_layernorm.weight)
        nxt = None if next_norm is None else (next_norm, c.rms_norm_eps)
        return self.mlp(h_normed, residual=h_normed.x, next_norm=nxt), k_pages, v_pages


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys are the target context (written by ``context_kv``) plus the block.

    K/V of context and block go through the same k_proj/v_proj and k_norm; only the block
    (queries) passes through input_layernorm first: the caller's ops.Normed, which the
    projections apply.
    """

    cfg: ModelConfig
    dtype: jnp.dtype
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        self.q_proj = Linear(c.q_size, c.hidden_size, c.attention_bias, self.dtype, self.plan)
        self.kv_proj = Linear(2 * c.kv_size, c.hidden_size, c.attention_bias, self.dtype, self.plan)
        self.o_proj = Linear(c.hidden_size, c.q_size, c.attention_bias, self.dtype, self.plan)
        self.q_norm = NormWeight(c.head_dim, self.dtype)
        self.k_norm = NormWeight(c.head_dim, self.dtype)

    def _write(self, q, kv, positions, slot_mapping, k_pages, v_pages):
        """q [B, T, H D] | None (the context: k and v only), kv [B, T, 2 KVH D] -> per-head
        norms, RoPE, k and v written: (q [B, T, H, D] | None, k_pages, v_pages). One kernel
        with the plan's GPU kernels (ops.rope_kv_write: [q | k | v] rows); under tensor
        parallelism XLA ops over the tp-interleaved k|v (ops.split_fused)."""
        c, plan = self.cfg, self.plan
        B, T, _ = kv.shape
        rope = rope_for(c.rope, c.head_dim, positions)
        if plan.tp == 1:
            qkv = kv if q is None else jnp.concatenate([q, kv], axis=-1)
            H = 0 if q is None else c.num_heads
            q, k_pages, v_pages = ops.rope_kv_write(plan, qkv, rope, slot_mapping, k_pages, v_pages,
                                                    self.q_norm.weight, self.k_norm.weight, num_heads=H,
                                                    eps=c.rms_norm_eps)
            return (None if H == 0 else q), k_pages, v_pages
        k, v = ops.split_fused(plan, kv, (c.kv_size, c.kv_size))  # k|v tp-interleaved
        k = rms_norm(k.reshape(B, T, c.num_kv_heads, c.head_dim), self.k_norm.weight, c.rms_norm_eps)
        k = rope_halves(k, *rope)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v.reshape(B, T, c.num_kv_heads, c.head_dim), slot_mapping)
        if q is not None:
            q = rope_halves(rms_norm(q.reshape(B, T, c.num_heads, c.head_dim), self.q_norm.weight, c.rms_norm_eps),
                            *rope)
        return q, k_pages, v_pages

    def context_kv(self, ctx, meta: AttentionMetadata, k_pages, v_pages):  # ctx: [B, C, H]
        _, k_pages, v_pages = self._write(None, self.kv_proj(ctx), meta.positions, meta.slot_mapping, k_pages, v_pages)
        return k_pages, v_pages

    def __call__(self, x, meta: AttentionMetadata, k_pages, v_pages, *, residual=None, out_norm=None):
        """x: the block [B, Q, H] as ops.Normed (input_layernorm, applied by q_proj and
        kv_proj); residual: added to the output; out_norm: [H], the RMSNorm after the block:
        the output comes as ops.Normed(residual + o_proj(.), out_norm) (ops.linear_then_norm)."""
        c = self.cfg
        B, Q, _ = x.shape
        q, k_pages, v_pages = self._write(self.q_proj(x), self.kv_proj(x), meta.positions, meta.slot_mapping,
                                          k_pages, v_pages)
        o = ops.attention(self.plan, q, k_pages, v_pages, meta, sm_scale=c.head_dim**-0.5).reshape(B, Q, c.q_size)
        if out_norm is None:
            return self.o_proj(o, residual=residual), k_pages, v_pages
        out = ops.linear_then_norm(self.plan, o, self.o_proj.weight, self.o_proj.bias, residual=residual,
                                   norm_w=out_norm, eps=c.rms_norm_eps)
        return out, k_pages, v_pages


class DFlashLayer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        self.input_layernorm = NormWeight(c.hidden_size, self.dtype)
        self.post_attention_layernorm = NormWeight(c.hidden_size, self.dtype)
        self.attn = DFlashAttention(c, self.dtype, self.plan)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, self.plan)

    def context_kv(self, ctx, meta, k_pages, v_pages):  # ctx: [B, C, H] (not input-normed)
        return self.attn.context_kv(ctx, meta, k_pages, v_pages)

    def __call__(self, x, meta, k_pages, v_pages, next_norm=None):
        """x: [B, Q, H] or ops.Normed (this layer's input norm handed over by the layer
        before); next_norm: the next layer's input-norm weight [H], which the MLP may hand
        over (ops.mlp), as in jspec.models.transformer.DecoderLayer. Pre-norm:
        h = x + attn(norm1(x)); out = h + mlp(norm2(h)), the norms applied by the projections."""
        eps = self.cfg.rms_norm_eps
        xn = x if isinstance(x, ops.Normed) else ops.Normed(x, self.input_layernorm.weight, eps)
        h, k_pages, v_pages = self.attn(xn, meta, k_pages, v_pages, residual=xn.x,
                                        out_norm=self.post_attention_layernorm.weight)
        nxt = None if next_norm is None else (next_norm, eps)
        return self.mlp(h, residual=h.x, next_norm=nxt), k_pages, v_pages
