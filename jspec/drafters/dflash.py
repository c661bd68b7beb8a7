"""The DFlash method: its block-diffusion drafter (Flax linen) over its own paged KV cache,
its config translation, parameter spec, proposal and registry entry (``METHOD``).

Per step, two calls (see dflash_propose):
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

Layouts: speculators (``speculators_model_type: "dflash"``) and z-lab's
(``architectures: ["DFlashDraftModel"]`` with ``dflash_config``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.checkpoint.param_spec import SpecList
from jspec.config import ConfigError, ModelConfig
from jspec.drafters.config import FMT_SPECULATORS, FMT_ZLAB_DFLASH, DrafterConfig, MethodFields, proposal_tokens
from jspec.drafters.eagle3 import DraftVocab, embed
from jspec.drafters.layers import DFlashLayer
from jspec.drafters.loader import add_layer_specs, load_from_spec
from jspec.drafters.method import Method
from jspec.drafters.propose import ProposeInputs, create_kv_cache, gather_rows, no_drafts, pick_drafts, span_metadata
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import Linear, RMSNorm, param
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
            self.lm_head = param(self, "lm_head", nn.initializers.normal(0.02),
                                 ops.weight_shape(self.plan, Vd, c.hidden_size), self.dtype)
        if c.has_d2t:
            self.d2t = param(self, "d2t", nn.initializers.zeros, (c.draft_vocab_size,), jnp.int32)

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


def from_hf(d: dict, fmt: str, shape: ModelConfig, target: ModelConfig, tensor_names) -> MethodFields:
    """DFlash's part of its config.json's translation (jspec/drafters/config.py): explicit
    aux layers, the block, its mask token, K within the block."""
    del shape, target, tensor_names  # its layers are Qwen3-style and share the target's embeddings
    if fmt == FMT_ZLAB_DFLASH:
        dc = d.get("dflash_config") or {}
        if dc.get("target_layer_ids") is None:
            raise ConfigError("config.json: dflash_config.target_layer_ids is missing (DFlash needs explicit layer ids)")
        # z-lab: "output of layer t" = canonical t + 1.
        aux = tuple(int(t) + 1 for t in dc["target_layer_ids"])
        mask_token_id = dc.get("mask_token_id")
    else:
        if d.get("aux_hidden_state_layer_ids") is None:
            raise ConfigError("config.json: aux_hidden_state_layer_ids is missing (DFlash needs explicit layer ids)")
        aux = tuple(int(c) for c in d["aux_hidden_state_layer_ids"])
        mask_token_id = d.get("mask_token_id")
    if "block_size" not in d:
        raise ConfigError("config.json: DFlash drafter without 'block_size'")
    block_size = int(d["block_size"])
    if block_size < 2:
        raise ConfigError(f"config.json: block_size={block_size} must be >= 2")
    if mask_token_id is None:
        raise ConfigError("config.json: DFlash drafter without mask_token_id")
    # The speculators format names its default K, as vLLM reads it (proposal_methods[0]);
    # z-lab's drafts the whole block. Either way the drafter runs its trained block.
    num_spec = proposal_tokens(d) if fmt == FMT_SPECULATORS else None
    if num_spec is None:
        num_spec = block_size - 1
    elif not 1 <= num_spec <= block_size - 1:
        raise ConfigError(f"config.json: speculative_tokens={num_spec} must be in 1..block_size - 1 "
                          f"({block_size - 1}): a DFlash drafter drafts from one block")
    return MethodFields(
        aux_layer_ids=aux, mask_token_id=mask_token_id, block_size=block_size, num_speculative_tokens=num_spec,
        qk_norm=True,  # DFlash layers are always Qwen3-style (q_norm / k_norm), whatever model_type says
        norm_before_residual=False, has_own_embeddings=False,
    )


def param_spec(c: DrafterConfig, specs: SpecList):
    """DFlash's tensors after the shared fc / norm / d2t (loader.drafter_param_spec), in load
    order: hidden_norm, the layers (q apart from the fused k/v), its own lm_head unless it
    reads the target's."""
    specs.add(("hidden_norm", "weight"), ["hidden_norm.weight"], [(c.hidden_size,)])
    for i in range(c.num_layers):
        add_layer_specs(specs, c, i, f"layers.{i}", c.hidden_size, fused_qkv=False)
    if not c.uses_target_lm_head:
        specs.add(("lm_head",), ["lm_head.weight"], [(c.draft_vocab_size, c.hidden_size)], vocab=True)


def dflash_propose(
    drafter: DFlashDrafter,
    params,
    kv: KVCache,
    inp: ProposeInputs,
    *,
    num_tokens: int | None = None,  # K (static); None: the whole block, block_size - 1
    with_probs: bool = False,
):  # -> (drafts i32[B, K], probs f32[B, K, Vt] | None, KVCache)
    """Context write of the verified positions, then one non-causal block forward.

    The block is always the trained block_size (its attention is non-causal, so the first
    drafts depend on every mask position after them); only the K drafts the engine keeps
    go through the lm_head and the pick (K = 1 on the family: the 7-row lm_head was ~0.19 ms
    of a ~3 ms CPU step).

    The context rows past last_idx (rejected drafts) are written too: they sit at positions
    >= the block start and the block write that follows overwrites them before any read.
    """
    aux, meta, last_idx, seeds, temperature, active = (
        inp.aux, inp.meta, inp.last_idx, inp.seeds, inp.temperature, inp.active)
    embed_table, target_lm_head = inp.embed, inp.lm_head
    bonus = gather_rows(inp.tokens, last_idx)  # i32[B]: the bonus token, at position last_pos + 1
    c = drafter.cfg
    bs = c.block_size
    variables = {"params": params}
    kv = drafter.apply(variables, aux, meta, kv, method=DFlashDrafter.write_context)
    if num_tokens == 0:
        return no_drafts(last_idx.shape[0], kv)
    pos = gather_rows(meta.positions, last_idx) + 1  # i32[B] block start = bonus position
    block = span_metadata(meta.page_table, pos, bs, active, kv.page_size, kv.num_pages, causal=False)
    B = bonus.shape[0]
    tokens = jnp.concatenate([bonus[:, None], jnp.full((B, bs - 1), c.mask_token_id, bonus.dtype)], 1)
    h, kv = drafter.apply(variables, tokens, block, kv, embed_table)
    n = bs - 1 if num_tokens is None else min(num_tokens, bs - 1)
    logits = drafter.apply(variables, h[:, 1:1 + n], target_lm_head, method=DFlashDrafter.logits)  # [B, K, V]
    return pick_drafts(drafter, variables, logits, pos + 1, temperature, seeds, with_probs, DFlashDrafter) + (kv,)


def lookahead(cfg: DrafterConfig, K: int) -> int:
    """The block: block_size positions from the bonus on, whatever K."""
    del K
    return cfg.block_size


def check_num_tokens(cfg: DrafterConfig, K: int) -> None:
    """K drafts come from one block: at most block_size - 1."""
    if K > cfg.block_size - 1:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={K} exceeds the DFlash block's "
            f"{cfg.block_size - 1} drafts (block_size={cfg.block_size})"
        )


METHOD = Method(
    label="DFlash", module=DFlashDrafter, propose=dflash_propose, lookahead=lookahead, reads_next_token=False,
    load=load_from_spec, create_cache=create_kv_cache, check_num_tokens=check_num_tokens, from_hf=from_hf,
    param_spec=param_spec, architectures=(("DFlashDraftModel", FMT_ZLAB_DFLASH),),
)
