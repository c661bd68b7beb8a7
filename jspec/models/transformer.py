"""Llama 3.x / Qwen3 decoder over the paged KV cache (Flax linen).

One forward serves prefill chunks, decode and multi-token verification: queries are
``tokens: i32[B, Q]`` at ``positions`` (inside ``AttentionMetadata``); the new K/V are
scattered into the paged cache first, then every query attends over its sequence's pages.

Besides the final-normed hidden states, the forward returns the residual stream at any
requested *canonical* indices (c = input of decoder layer c; c = 0 is the embedding output,
c = L the last layer's output before the final norm), captured in the same pass.

Parameter tree (HF names -> ours are mapped in jspec/checkpoint/target.py):
  embed_tokens/embedding [V, H]; layers_i/{input_layernorm, post_attention_layernorm}/weight [H];
  layers_i/attn/qkv_proj/weight [(Hq + 2 Hkv) * D, H] (+ bias); layers_i/attn/o_proj/weight;
  layers_i/attn/{q_norm,k_norm}/weight [D] (Qwen3); layers_i/mlp/gate_up_proj/weight [2I, H];
  layers_i/mlp/down_proj/weight [H, I]; norm/weight [H]; lm_head [V, H] (untied only).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec.config import ModelConfig
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import GatedMLP, Linear, RMSNorm, rope_inv_freq
from kernels_pallas.fused_linear import fused_linear, norm_handoff
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write
from kernels_pallas.qkv_rope_kv_write import use_kernel as qkv_kernel
from kernels_pallas.rope_kv_write import rope_kv_write, rope_tables


class Attention(nn.Module):
    """Self-attention over the paged cache; q/k/v read ``in_features`` (0: hidden_size;
    EAGLE3's first drafter layer reads 2H). With ``norm_w`` the input RMSNorm happens in
    the qkv projection, with ``residual`` the residual add in o_proj (fused into their
    kernels when ``linear_impl`` selects them). With ``next_norm_w`` the o_proj output comes
    as (h, h * next_norm_w, partial sums of h^2): the RMSNorm hand-over (norm_handoff)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    attn_impl: str = "reference"
    in_features: int = 0
    linear_impl: str = "reference"  # fused_linear / rope_kv_write impl

    @nn.compact
    def __call__(self, x, meta: AttentionMetadata, k_pages, v_pages, *, norm_w=None, residual=None, rope=None,
                 next_norm_w=None):
        c = self.cfg
        B, Q, _ = x.shape
        d_in = self.in_features or c.hidden_size
        qkv_proj = Linear(c.q_size + 2 * c.kv_size, d_in, c.attention_bias, self.dtype, self.linear_impl,
                          name="qkv_proj")
        cos, sin = rope if rope is not None else rope_tables(meta.positions, rope_inv_freq(c.rope, c.head_dim))
        w, b = qkv_proj()
        if norm_w is not None and not c.qk_norm and qkv_kernel(self.linear_impl, x.reshape(B * Q, -1), w, k_pages):
            # Batch-1 decode on GPU: norm, projection, RoPE and KV write in one kernel.
            q, k_pages, v_pages = qkv_rope_kv_write(
                x.reshape(1, -1), w, norm_w, b, cos.reshape(1, -1), sin.reshape(1, -1), meta.slot_mapping.reshape(1),
                k_pages, v_pages, num_heads=c.num_heads, eps=c.rms_norm_eps, impl=self.linear_impl)
        else:
            qkv = qkv_proj(x, prologue="none" if norm_w is None else "rmsnorm", norm_w=norm_w, eps=c.rms_norm_eps)
            qn = kn = None
            if c.qk_norm:
                qn = RMSNorm(c.rms_norm_eps, self.dtype, c.head_dim, name="q_norm")()
                kn = RMSNorm(c.rms_norm_eps, self.dtype, c.head_dim, name="k_norm")()
            q, k_pages, v_pages = rope_kv_write(
                qkv.reshape(B * Q, -1), cos.reshape(B * Q, -1), sin.reshape(B * Q, -1),
                meta.slot_mapping.reshape(B * Q), k_pages, v_pages, qn, kn, num_heads=c.num_heads,
                eps=c.rms_norm_eps, impl=self.linear_impl,
            )
        o = paged_attention(
            q.reshape(B, Q, c.num_heads, c.head_dim), k_pages, v_pages, meta.page_table, meta.kv_lens,
            meta.positions, meta.causal, sm_scale=c.head_dim**-0.5, impl=self.attn_impl,
        )
        o = Linear(c.hidden_size, c.q_size, c.attention_bias, self.dtype, self.linear_impl, name="o_proj")(
            o.reshape(B, Q, c.q_size), residual=residual, next_norm_w=next_norm_w)
        return o, k_pages, v_pages


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. Both norms and both residual adds are passed into the
    projections, which fuse them on GPU at small batch (four weight-streaming kernels,
    one RoPE + KV-write kernel and the attention per layer; without qk-norm the first
    projection also does RoPE and the KV write)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    attn_impl: str = "reference"
    linear_impl: str = "reference"

    @nn.compact
    def __call__(self, x, meta, k_pages, v_pages, rope=None):
        c = self.cfg
        ln1 = RMSNorm(c.rms_norm_eps, self.dtype, c.hidden_size, name="input_layernorm")()
        ln2 = RMSNorm(c.rms_norm_eps, self.dtype, c.hidden_size, name="post_attention_layernorm")()
        handoff = norm_handoff(self.linear_impl, x.shape[0] * x.shape[1], (c.hidden_size, c.q_size),
                               (c.hidden_size, c.intermediate_size))
        x, k_pages, v_pages = Attention(c, self.dtype, self.attn_impl, linear_impl=self.linear_impl, name="attn")(
            x, meta, k_pages, v_pages, norm_w=ln1, residual=x, rope=rope, next_norm_w=ln2 if handoff else None)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, self.linear_impl, name="mlp")
        if handoff:  # o_proj's kernel wrote (h, h * ln2, partial sums of h^2); down applies 1 / rms
            x, x_scaled, sumsq = x
            return mlp(x, eps=c.rms_norm_eps, residual=x, normed=(x_scaled, sumsq)), k_pages, v_pages
        return mlp(x, norm_w=ln2, eps=c.rms_norm_eps, residual=x), k_pages, v_pages


class Transformer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attn_impl: str = "reference"
    linear_impl: str = "reference"  # "reference" (XLA) | "gpu" | "interpret": fused_linear, rope_kv_write

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, self.attn_impl, self.linear_impl, name=f"layers_{i}")
                       for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            # a bare [V, H] array so logits can accumulate in float32 (see logits()).
            self.lm_head = self.param("lm_head", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size), self.dtype)

    def __call__(
        self,
        tokens,  # i32[B, Q]
        meta: AttentionMetadata,
        kv: KVCache,
        aux_layers: tuple[int, ...] = (),  # canonical indices to capture, static
    ):  # -> (hidden f[B, Q, H] after the final norm, aux f[B, Q, len(aux), H] | None, KVCache)
        L = self.cfg.num_layers
        for c in aux_layers:
            if not 0 <= c <= L:
                raise ValueError(f"aux layer index {c} out of range [0, {L}] for a {L}-layer target")
        x = self.embed_tokens(tokens)
        captured = {}
        ks, vs = list(kv.k), list(kv.v)
        rope = rope_tables(meta.positions, rope_inv_freq(self.cfg.rope, self.cfg.head_dim))  # once for all layers
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                captured[i] = x
            x, ks[i], vs[i] = layer(x, meta, ks[i], vs[i], rope)
        if L in aux_layers:
            captured[L] = x
        aux = jnp.stack([captured[c] for c in aux_layers], axis=2) if aux_layers else None
        return self.norm(x), aux, KVCache(k=tuple(ks), v=tuple(vs))

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, h):  # f[..., H] (already normed) -> f32[..., V]
        w = self.embed_tokens.embedding if self.cfg.tie_word_embeddings else self.lm_head
        return fused_linear(h, w, out_dtype=jnp.float32, impl=self.linear_impl)
