"""DFlash block-diffusion drafter (Flax linen) over its own paged KV cache.

Per step, two calls (see propose.dflash_propose):
  1. ``write_context(aux, ctx_meta, kv)``: ctx = hidden_norm(fc(concat of target aux
     states)) at the newly verified positions; every layer projects ctx with its
     k_proj/v_proj (k_norm, RoPE at the true positions; no input_layernorm) and writes
     it into the drafter cache at those positions, where it stays across steps.
  2. ``__call__(block_tokens, block_meta, kv, embed_table)``: the block
     [bonus, MASK x (block_size - 1)] at positions start .. start + block_size - 1,
     embedded with the target's embeddings, goes through Qwen3-style layers whose block
     K/V (input_layernorm -> k_proj/v_proj, same weights as the context) are written at
     the block positions; attention is non-causal (``block_meta.causal = False``) over
     all context K/V plus the whole block. The block K/V are overwritten by the next
     step's context write.
Logits come from the target's lm_head (full vocab) or the drafter's own reduced-vocab
lm_head + d2t; drafts are read at block positions 1 .. block_size - 1.

This matches speculators' Qwen3DFlashAttention: k = k_norm(k_proj(cat[ctx, norm(block)])),
v = v_proj(same), q = q_norm(q_proj(norm(block))), RoPE over the concatenated positions.

Parameter tree: fc/weight [H, n*Ht]; hidden_norm/weight [H]; layers_i/{input_layernorm,
post_attention_layernorm}/weight; layers_i/attn/{q_proj [Hq*D, H], kv_proj [2*Hkv*D, H],
o_proj, q_norm, k_norm}; layers_i/mlp/{gate_up_proj, down_proj}; norm/weight;
lm_head [Vd, H] + d2t i32[Vd] (reduced vocab only). Projection weights (``weight``,
``lm_head``) are [in, out] under the CPU plan (ops.weight_shape).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.drafters.config import DrafterConfig
from jspec.drafters.eagle3 import DraftVocab, embed
from jspec.drafters.layers import DFlashLayer
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import Linear, RMSNorm
from jspec.models.transformer import next_input_norm
from jspec.ops import KernelPlan


class DFlashDrafter(DraftVocab, nn.Module):
    cfg: DrafterConfig
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        if c.method != "dflash":
            raise ValueError(f"DFlashDrafter serves dflash drafters, got method={c.method!r}")
        lc = c.layer_config()
        self.fc = Linear(c.hidden_size, c.fc_in_features, False, self.dtype, self.plan)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.layers = [DFlashLayer(lc, self.dtype, self.plan, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.uses_target_lm_head:
            Vd = ops.vocab_rows(self.plan, c.draft_vocab_size)  # padded under tensor parallelism
            self.lm_head = self.param("lm_head", nn.initializers.normal(0.02),
                                      ops.weight_shape(self.plan, Vd, c.hidden_size), self.dtype)
        if c.has_d2t:
            self.d2t = self.param("d2t", nn.initializers.zeros, (c.draft_vocab_size,), jnp.int32)

    def write_context(
        self,
        aux,  # f[B, C, n*Ht]: target aux states at the newly verified positions
        meta: AttentionMetadata,  # positions / slot_mapping of those C positions (padding: drop slot)
        kv: KVCache,
    ) -> KVCache:
        ctx = self.hidden_norm(self.fc(aux.astype(self.dtype)))  # [B, C, H]
        ks, vs = list(kv.k), list(kv.v)
        for i, layer in enumerate(self.layers):
            ks[i], vs[i] = layer.context_kv(ctx, meta, ks[i], vs[i])
        return KVCache(k=tuple(ks), v=tuple(vs))

    def __call__(
        self,
        tokens,  # i32[B, bs]: [bonus, mask_token_id x (bs - 1)]
        meta: AttentionMetadata,  # block positions start..start+bs-1, kv_lens = start + bs, causal False
        kv: KVCache,
        embed_table,  # f[Vt, H]: the target's embeddings
    ):  # -> (normed hidden f[B, bs, H], KVCache)
        x = embed(self.plan, embed_table, tokens, own=False).astype(self.dtype)
        ks, vs = list(kv.k), list(kv.v)
        for i, layer in enumerate(self.layers):  # each layer may hand the next one's input norm over (ops.mlp)
            x, ks[i], vs[i] = layer(x, meta, ks[i], vs[i], next_norm=next_input_norm(self.layers, i))
        return self.norm(x), KVCache(k=tuple(ks), v=tuple(vs))

    def logits(self, h, target_lm_head=None):  # h: normed f[..., H] -> f32[..., V]
        """target_lm_head: the target's output projection in the plan's layout, f[Vt, H]
        ([H, Vt] under in_out_weights; Vt padded as the target holds it under tensor
        parallelism): Transformer.lm_head_weight. Either head's padded rows are sliced off
        (ops.logits): V is draft_vocab_size (the target's with its lm_head)."""
        w = target_lm_head if self.cfg.uses_target_lm_head else self.lm_head
        if w is None:
            raise ValueError("this DFlash drafter uses the target's lm_head: pass target_lm_head=[Vt, H]")
        return ops.logits(self.plan, h, w, vocab_size=self.cfg.draft_vocab_size)
