"""The EAGLE3 method: its drafter (Flax linen) over its own paged KV cache, its config
translation, parameter spec, proposal and registry entry (``METHOD``). PEagle shares the
module class and the translation (jspec/drafters/peagle.py).

One call runs the drafter over ``tokens: i32[B, Q]`` paired with hidden inputs:
  - first pass (``hidden_is_fc_input=True``): hidden = concat of the target's aux states
    [B, Q, num_aux * Ht] (fc-projected here); token i+1 is paired with target hidden i;
  - later steps (``hidden_is_fc_input=False``): hidden = the drafter's own previous
    *pre-norm* output [B, Q, H] (no fc).
The returned pre-norm output is both the next step's hidden input and, through
``logits`` (final norm + lm_head), the draft distribution over the draft vocab.

Parameter tree (HF names: ``param_spec`` below, the shared parts in jspec/drafters/loader.py):
  fc/weight [H, n*Ht]; input_norm/weight [n*Ht] (norm_before_fc);
  embed_tokens [Vt, H] (own embeddings only); layers_0/{input_layernorm, hidden_norm,
  post_attention_layernorm}/weight [H]; layers_0/attn/qkv_proj/weight [(Hq+2Hkv)*D, 2H];
  layers_0/attn/o_proj/weight; layers_0/attn/{q_norm,k_norm}/weight [D] (qwen3 layers);
  layers_0/mlp/{gate_up_proj,down_proj}/weight; layers_i (i >= 1): target-style layers;
  norm/weight [H]; lm_head [Vd, H]; d2t i32[Vd] (reduced vocab); mask_hidden [n*Ht] (PEagle).
  Under tensor parallelism the rows of embed_tokens and lm_head are padded to a multiple of
  tp (ops.vocab_rows); d2t and the logits keep Vd.
Projection weights (``weight``, ``lm_head``) are [in, out] under the CPU plan (ops.weight_shape).

Layouts: speculators (``speculators_model_type: "eagle3"``) and the original EAGLE3
(``architectures: ["LlamaForCausalLMEagle3"]``, one ``midlayer``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.checkpoint.param_spec import SpecList
from jspec.config import ConfigError, ModelConfig
from jspec.drafters.config import FMT_EAGLE3_ORIGINAL, DrafterConfig, MethodFields, proposal_tokens
from jspec.drafters.layers import Eagle3FirstLayer
from jspec.drafters.loader import add_layer_specs, load_from_spec
from jspec.drafters.method import Method
from jspec.drafters.propose import ProposeInputs, create_kv_cache, gather_rows, no_drafts, pick, span_metadata
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import Linear, RMSNorm, param
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
            self.embed_tokens = param(self, "embed_tokens", _normal,
                                      (ops.vocab_rows(self.plan, c.target_vocab_size), c.hidden_size), self.dtype)
        self.layers = [Eagle3FirstLayer(lc, c.norm_before_residual, self.dtype, self.plan, name="layers_0")] + [
            DecoderLayer(lc, self.dtype, self.plan, name=f"layers_{i}") for i in range(1, c.num_layers)
        ]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        # A bare [Vd, H] array, never tied to the embeddings (reduced vocab rows differ);
        # Vd padded under tensor parallelism (ops.vocab_rows), sliced off by logits().
        self.lm_head = param(self, "lm_head", _normal,
                             ops.weight_shape(self.plan, ops.vocab_rows(self.plan, c.draft_vocab_size),
                                              c.hidden_size), self.dtype)
        if c.has_d2t:
            self.d2t = param(self, "d2t", nn.initializers.zeros, (c.draft_vocab_size,), jnp.int32)
        if c.method == "peagle":
            self.mask_hidden = param(self, "mask_hidden", _normal, (c.fc_in_features,), self.dtype)

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


def chain_fields(d: dict, shape: ModelConfig, target: ModelConfig, tensor_names, *, mask_token_id: int | None,
                 norm_before_residual: bool) -> MethodFields:
    """The fields of an EAGLE-style head (EAGLE3, PEagle) from config.json ``d``: its aux
    layers (the target's defaults when unnamed), the checkpoint's K, own embeddings when it
    has them; ``norm_before_residual``: the default when the key is absent (vLLM's)."""
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    return MethodFields(
        aux_layer_ids=tuple(int(c) for c in ids) if ids is not None else target.default_aux_layers(),
        mask_token_id=mask_token_id,
        block_size=None,
        num_speculative_tokens=proposal_tokens(d),
        qk_norm=shape.qk_norm,
        norm_before_residual=bool(d.get("norm_before_residual", norm_before_residual)),
        has_own_embeddings="embed_tokens.weight" in tensor_names,
    )


def from_hf(d: dict, fmt: str, shape: ModelConfig, target: ModelConfig, tensor_names) -> MethodFields:
    """EAGLE3's part of its config.json's translation (jspec/drafters/config.py)."""
    del fmt  # both layouts name the same keys
    return chain_fields(d, shape, target, tensor_names, mask_token_id=None, norm_before_residual=True)


def param_spec(c: DrafterConfig, specs: SpecList, *, mask_hidden: bool = False):
    """The head's tensors after the shared fc / norm / d2t (loader.drafter_param_spec), in
    load order; ``mask_hidden``: PEagle's learned mask-slot input."""
    H = c.hidden_size
    if c.norm_before_fc:
        specs.add(("input_norm", "weight"), ["input_norm.weight"], [(c.fc_in_features,)])
    if c.has_own_embeddings:
        specs.add(("embed_tokens",), ["embed_tokens.weight"], [(c.target_vocab_size, H)], vocab=True)
    specs.add(("lm_head",), ["lm_head.weight"], [(c.draft_vocab_size, H)], vocab=True)
    if mask_hidden:
        specs.add(("mask_hidden",), ["mask_hidden"], [(1, 1, c.fc_in_features)], shape=(c.fc_in_features,))
    if c.source_format == FMT_EAGLE3_ORIGINAL:
        if c.num_layers != 1:
            raise ConfigError(f"config.json: original-format EAGLE3 has one 'midlayer', got num_hidden_layers={c.num_layers}")
        prefixes = ["midlayer"]
    else:
        prefixes = [f"layers.{i}" for i in range(c.num_layers)]
    for i, prefix in enumerate(prefixes):  # the first layer reads [embedding, hidden]: 2 H
        add_layer_specs(specs, c, i, prefix, 2 * H if i == 0 else H, fused_qkv=True)
    specs.add(("layers_0", "hidden_norm", "weight"), [f"{prefixes[0]}.hidden_norm.weight"], [(H,)])


def eagle3_propose(
    drafter: Eagle3Drafter,  # static (hashable module)
    params,
    kv: KVCache,
    inp: ProposeInputs,
    *,
    num_tokens: int,  # K, static
    with_probs: bool = False,
):  # -> (drafts i32[B, K], probs f32[B, K, Vt] | None, KVCache)
    """The first pass over the accepted pairs, then K - 1 single-token steps feeding back the
    pre-norm hidden state."""
    tokens, aux, meta, last_idx, seeds, temperature, active = (
        inp.tokens, inp.aux, inp.meta, inp.last_idx, inp.seeds, inp.temperature, inp.active)
    embed_table = None if drafter.cfg.has_own_embeddings else inp.embed
    variables = {"params": params}
    h, kv = drafter.apply(variables, tokens, aux, meta, kv, embed_table, hidden_is_fc_input=True)
    if not num_tokens:
        return no_drafts(last_idx.shape[0], kv)
    h = gather_rows(h, last_idx)[:, None]  # [B, 1, H] pre-norm output at the bonus pair
    pos = gather_rows(meta.positions, last_idx)  # i32[B]
    page_size, num_pages = kv.page_size, kv.num_pages
    drafts, probs = [], []
    for j in range(num_tokens):
        logits = drafter.apply(variables, h[:, 0], method=Eagle3Drafter.logits)  # [B, Vd]
        ids, p = pick(logits, temperature, seeds, pos + 2 + j, with_probs)  # key: the draft's sequence position
        tok = drafter.apply(variables, ids, method=Eagle3Drafter.to_target_ids)
        drafts.append(tok)
        if with_probs:
            probs.append(drafter.apply(variables, p, method=Eagle3Drafter.probs_to_target))
        if j + 1 < num_tokens:
            step = span_metadata(meta.page_table, pos + j + 1, 1, active, page_size, num_pages, causal=True)
            h, kv = drafter.apply(variables, tok[:, None], h, step, kv, embed_table, hidden_is_fc_input=False)
    return jnp.stack(drafts, 1), (jnp.stack(probs, 1) if with_probs else None), kv


def lookahead(cfg: DrafterConfig, K: int) -> int:
    """K - 1 positions past the bonus pair, and the bonus pair's own slot."""
    del cfg
    return K


METHOD = Method(
    label="EAGLE3", module=Eagle3Drafter, propose=eagle3_propose, lookahead=lookahead, reads_next_token=True,
    load=load_from_spec, create_cache=create_kv_cache, from_hf=from_hf, param_spec=param_spec,
    architectures=(("LlamaForCausalLMEagle3", FMT_EAGLE3_ORIGINAL),),
)
