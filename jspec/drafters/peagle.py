"""The PEagle method (parallel EAGLE): the EAGLE3 module drafting all K tokens in one forward;
its config translation, parameter spec, proposal and registry entry (``METHOD``).

The forward runs over [pairs..., MASK x (K-1)]: each pair is (token t+1, target aux
states at t) as in EAGLE3, the last pair being (bonus token, aux at the last verified
position); the K-1 mask slots carry ``mask_token_id`` and the learned ``mask_hidden``
(fc-projected like real aux states) at the next K-1 positions. Attention is ordinary
causal attention by position, so the mask slots may sit anywhere along the query axis
(``peagle_propose`` appends them after the padded pairs). Draft k (k = 0..K-1)
is read at the last pair (k = 0) and at mask slot k.

Its checkpoint is EAGLE3's speculators layout (``speculators_model_type: "peagle"``) plus
``mask_token_id`` and the ``mask_hidden`` tensor.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.checkpoint.param_spec import SpecList
from jspec.config import ConfigError, ModelConfig
from jspec.drafters import eagle3
from jspec.drafters.config import DrafterConfig, MethodFields
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.loader import load_from_spec
from jspec.drafters.method import Method
from jspec.drafters.propose import ProposeInputs, create_kv_cache, gather_rows, no_drafts, pick_drafts, span_metadata
from jspec.kv_cache import KVCache, MixedMetadata

PEagleDrafter = Eagle3Drafter  # cfg.method == "peagle" adds the mask_hidden parameter


def from_hf(d: dict, fmt: str, shape: ModelConfig, target: ModelConfig, tensor_names) -> MethodFields:
    """PEagle's part of its config.json's translation: EAGLE3's, with the mask slots' token
    and tensor required and norm_before_residual False by default (vLLM's)."""
    del fmt  # speculators only
    mask_token_id = d.get("mask_token_id")
    if mask_token_id is None:
        raise ConfigError("config.json: PEagle drafter without mask_token_id")
    if "mask_hidden" not in tensor_names:
        raise ConfigError("checkpoint: PEagle drafter without the 'mask_hidden' tensor")
    return eagle3.chain_fields(d, shape, target, tensor_names, mask_token_id=mask_token_id,
                               norm_before_residual=False)


def param_spec(c: DrafterConfig, specs: SpecList):
    """EAGLE3's tensors and ``mask_hidden``."""
    eagle3.param_spec(c, specs, mask_hidden=True)


def peagle_propose(
    drafter: Eagle3Drafter,  # cfg.method == "peagle"
    params,
    kv: KVCache,
    inp: ProposeInputs,
    *,
    num_tokens: int,  # K, static
    with_probs: bool = False,
):  # -> (drafts i32[B, K], probs f32[B, K, Vt] | None, KVCache)
    """One forward over the pairs and K - 1 mask slots appended after them (COD positions)."""
    tokens, aux, meta, last_idx, seeds, temperature, active = (
        inp.tokens, inp.aux, inp.meta, inp.last_idx, inp.seeds, inp.temperature, inp.active)
    embed_table = None if drafter.cfg.has_own_embeddings else inp.embed
    c = drafter.cfg
    N, M = last_idx.shape[0], num_tokens - 1
    pos = gather_rows(meta.positions, last_idx)  # i32[N] position of the bonus pair
    variables = {"params": params}
    if M <= 0:
        h, kv = drafter.apply(variables, tokens, aux, meta, kv, embed_table, hidden_is_fc_input=True)
        if not num_tokens:
            return no_drafts(N, kv)
        logits = drafter.apply(variables, gather_rows(h, last_idx)[:, None], method=Eagle3Drafter.logits)
        return pick_drafts(drafter, variables, logits, pos + 2, temperature, seeds, with_probs, Eagle3Drafter) + (kv,)
    # The mask slots [N, M] after the pairs, one forward over both (jspec.kv_cache.MixedMetadata:
    # both written, then attention per part): a slot sees its row's pairs by position.
    masks = span_metadata(meta.page_table, pos + 1, M, active, kv.page_size, kv.num_pages, causal=True)
    n_pairs = tokens.size
    all_meta = MixedMetadata((meta, masks))
    all_tokens = jnp.concatenate([tokens.reshape(1, -1), jnp.full((1, N * M), c.mask_token_id, tokens.dtype)], 1)
    all_aux = jnp.concatenate([aux.reshape(1, n_pairs, -1), jnp.zeros((1, N * M, aux.shape[-1]), aux.dtype)], 1)
    mask_slots = jnp.concatenate([jnp.zeros((1, n_pairs), bool), jnp.ones((1, N * M), bool)], 1)
    h, kv = drafter.apply(variables, all_tokens, all_aux, all_meta, kv, embed_table,
                          hidden_is_fc_input=True, mask_slots=mask_slots)
    pairs_h = h[:, :n_pairs].reshape(tokens.shape + h.shape[-1:])
    rows = jnp.concatenate([gather_rows(pairs_h, last_idx)[:, None], h[0, n_pairs:].reshape(N, M, -1)], 1)  # [N, K, H]
    logits = drafter.apply(variables, rows, method=Eagle3Drafter.logits)  # [B, K, Vd]
    return pick_drafts(drafter, variables, logits, pos + 2, temperature, seeds, with_probs, Eagle3Drafter) + (kv,)


# The mask slots write K - 1 positions past the bonus pair, as EAGLE3's steps do.
METHOD = Method(
    label="PEagle", module=Eagle3Drafter, propose=peagle_propose, lookahead=eagle3.lookahead, reads_next_token=True,
    load=load_from_spec, create_cache=create_kv_cache, from_hf=from_hf, param_spec=param_spec,
)
