"""EAGLE3 drafter (Flax linen) over its own paged KV cache; PEagle shares this module.

One call runs the drafter over ``tokens: i32[B, Q]`` paired with hidden inputs:
  - first pass (``hidden_is_fc_input=True``): hidden = concat of the target's aux states
    [B, Q, num_aux * Ht] (fc-projected here); token i+1 is paired with target hidden i;
  - later steps (``hidden_is_fc_input=False``): hidden = the drafter's own previous
    *pre-norm* output [B, Q, H] (no fc).
The returned pre-norm output is both the next step's hidden input and, through
``logits`` (final norm + lm_head), the draft distribution over the draft vocab.

Parameter tree (HF names are mapped in jspec/drafters/loader.py):
  fc/weight [H, n*Ht]; input_norm/weight [n*Ht] (norm_before_fc);
  embed_tokens [Vt, H] (own embeddings only); layers_0/{input_layernorm, hidden_norm,
  post_attention_layernorm}/weight [H]; layers_0/attn/qkv_proj/weight [(Hq+2Hkv)*D, 2H];
  layers_0/attn/o_proj/weight; layers_0/attn/{q_norm,k_norm}/weight [D] (qwen3 layers);
  layers_0/mlp/{gate_up_proj,down_proj}/weight; layers_i (i >= 1): target-style layers;
  norm/weight [H]; lm_head [Vd, H]; d2t i32[Vd] (reduced vocab); mask_hidden [n*Ht] (PEagle).
  Under tensor parallelism the rows of embed_tokens and lm_head are padded to a multiple of
  tp (ops.vocab_rows); d2t and the logits keep Vd.
Projection weights (``weight``, ``lm_head``) are [in, out] under the CPU plan (ops.weight_shape).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.drafters.config import DrafterConfig
from jspec.drafters.layers import Eagle3FirstLayer
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import Linear, RMSNorm
from jspec.models.transformer import DecoderLayer, next_input_norm
from jspec.ops import KernelPlan

_normal = nn.initializers.normal(0.02)


def embed(plan: KernelPlan, table, tokens, *, own: bool):  # table: [V, H], tokens: i32[...] -> [..., H]
    """The drafter's embedding of ``tokens`` (ops.embed): its own table, split like its
    weights (plan.tp), or the target's, split over the whole mesh (the target's tp)."""
    shards = plan.tp if own else (1 if plan.mesh is None else plan.mesh.size)
    return ops.embed(plan, table, tokens, shards=shards)


def draft_to_target_ids(ids, d2t):  # ids: i32[...] draft ids, d2t: i32[Vd] | None -> i32[...]
    """EAGLE3's d2t holds offsets: target_id = i + d2t[i]. None: full vocab, identity."""
    if d2t is None:
        return ids
    return ids + jnp.take(d2t, ids, axis=0, mode="clip")


def draft_probs_to_target(probs, d2t, target_vocab_size: int):  # probs: f[..., Vd] -> f[..., Vt]
    """Scatter draft-vocab probabilities into the target vocab (zeros elsewhere)."""
    if d2t is None:
        return probs
    tgt = jnp.arange(probs.shape[-1], dtype=jnp.int32) + d2t  # i32[Vd], distinct target ids
    out = jnp.zeros(probs.shape[:-1] + (target_vocab_size,), probs.dtype)
    return out.at[..., tgt].set(probs)


class DraftVocab:
    """Draft ids and probabilities in the target's vocabulary, for a drafter module with
    ``cfg`` (DrafterConfig) and, when ``cfg.has_d2t``, a ``d2t`` parameter."""

    def to_target_ids(self, ids):  # i32[...] draft ids -> i32[...] target ids
        return draft_to_target_ids(ids, self.d2t if self.cfg.has_d2t else None)

    def probs_to_target(self, probs):  # f[..., Vd] -> f[..., Vt]
        return draft_probs_to_target(probs, self.d2t if self.cfg.has_d2t else None, self.cfg.target_vocab_size)


class Eagle3Drafter(DraftVocab, nn.Module):
    """EAGLE3 / PEagle drafter. ``cfg.method`` in {"eagle3", "peagle"}."""

    cfg: DrafterConfig
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        if c.method not in ("eagle3", "peagle"):
            raise ValueError(f"Eagle3Drafter serves eagle3/peagle drafters, got method={c.method!r}")
        lc = c.layer_config()
        if c.norm_before_fc:
            self.input_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.fc = Linear(c.hidden_size, c.fc_in_features, False, self.dtype, self.plan)
        if c.has_own_embeddings:
            self.embed_tokens = self.param("embed_tokens", _normal,
                                           (ops.vocab_rows(self.plan, c.target_vocab_size), c.hidden_size), self.dtype)
        self.layers = [Eagle3FirstLayer(lc, c.norm_before_residual, self.dtype, self.plan, name="layers_0")] + [
            DecoderLayer(lc, self.dtype, self.plan, name=f"layers_{i}") for i in range(1, c.num_layers)
        ]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        # A bare [Vd, H] array, never tied to the embeddings (reduced vocab rows differ);
        # Vd padded under tensor parallelism (ops.vocab_rows), sliced off by logits().
        self.lm_head = self.param("lm_head", _normal,
                                  ops.weight_shape(self.plan, ops.vocab_rows(self.plan, c.draft_vocab_size),
                                                   c.hidden_size), self.dtype)
        if c.has_d2t:
            self.d2t = self.param("d2t", nn.initializers.zeros, (c.draft_vocab_size,), jnp.int32)
        if c.method == "peagle":
            self.mask_hidden = self.param("mask_hidden", _normal, (c.fc_in_features,), self.dtype)

    def __call__(
        self,
        tokens,  # i32[B, Q] target-vocab ids
        hidden,  # f[B, Q, n*Ht] if hidden_is_fc_input else f[B, Q, H]
        meta: AttentionMetadata,  # the drafter's own positions / slots; causal
        kv: KVCache,  # the drafter's cache: num_layers x [P, S, KVH, D]
        embed_table=None,  # f[Vt, H]: the target's embeddings (unused with own embeddings)
        *,
        hidden_is_fc_input: bool,
        mask_slots=None,  # bool[B, Q] | None (PEagle): slots whose hidden input is mask_hidden
    ):  # -> (pre-norm output f[B, Q, H], KVCache)
        c = self.cfg
        if hidden_is_fc_input:
            if mask_slots is not None:
                hidden = jnp.where(mask_slots[..., None], self.mask_hidden.astype(hidden.dtype), hidden)
            if c.norm_before_fc:
                hidden = self.input_norm(hidden)
            hidden = self.fc(hidden)
        table = self.embed_tokens if c.has_own_embeddings else embed_table
        if table is None:
            raise ValueError("this drafter shares the target's embeddings: pass embed_table=[Vt, H]")
        e = embed(self.plan, table, tokens, own=c.has_own_embeddings).astype(self.dtype)
        ks, vs = list(kv.k), list(kv.v)
        # Each layer may hand the next one's input norm over (ops.mlp); the last one's output
        # is the pre-norm hidden state the next step reads.
        x, ks[0], vs[0] = self.layers[0](e, hidden.astype(self.dtype), meta, ks[0], vs[0],
                                         next_norm=next_input_norm(self.layers, 0))
        for i in range(1, c.num_layers):
            x, ks[i], vs[i] = self.layers[i](x, meta, ks[i], vs[i], next_norm=next_input_norm(self.layers, i))
        return x, KVCache(k=tuple(ks), v=tuple(vs))

    def logits(self, pre_norm_out):  # f[..., H] -> f32[..., Vd]
        h = self.norm(pre_norm_out)
        return ops.logits(self.plan, h, self.lm_head, vocab_size=self.cfg.draft_vocab_size)


def create_kv_cache(cfg: DrafterConfig, num_pages: int, page_size: int, dtype, sharding=None) -> KVCache:
    """The drafter's own cache; same page ids as the target's page table, own buffers."""
    return KVCache.create(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, sharding)
