"""Functional draft proposal for the engine's jitted step (EAGLE3, PEagle, DFlash).

The drafter's KV cache mirrors the target's paging: same page ids (the target's
``page_table``), its own buffers (``create_kv_cache``). A drafter K/V for position p lives
in slot ``page_table[b, p // S] * S + p % S``, exactly where the target keeps p.

Terms, for one sequence in a step: the target just verified positions s .. s+n (tokens
[x_s, d_1..d_n]) and accepted a drafts; the sequence continues with the bonus token b.
"Pairs" are (token at p+1, target aux states at p): (d_1, aux[s]), ..., (d_a, aux[s+a-1]),
(b, aux[s+a]). For a prefill chunk of positions s..e the pairs are (x_{p+1}, aux[p]) with
the sampled token as the last one.

What the engine passes (all shapes padded to its buckets), in either of two layouts: rows
[B, Q] (N = B) with AttentionMetadata, or a flat step's tokens [1, T] with the target's
RaggedMetadata (jspec/engine/flat_input.py; N sequences, index i of last_idx into T):
  tokens   i32[B, Q]      pair tokens, pair i at position positions[b, i]. Rows past the
                          last accepted pair may hold anything (e.g. the rejected drafts):
                          attention is causal by position and later writes overwrite them.
  aux      f[B, Q, n*Ht]  target aux states (Transformer(aux_layers=cfg.aux_layer_ids))
                          at the same positions, concatenated in aux_layer_ids order.
  meta     the metadata of those positions for the drafter cache: the target's own works
           as is (page_table, positions, slot_mapping with P*S for padding, kv_lens = last
           written position + 1, causal True).
  last_idx i32[N]         index of each sequence's last real pair (the bonus pair).
  seeds, temperature      f32/i32[B]: temperature 0 -> greedy (argmax) drafts; > 0 ->
                          drafts sampled from softmax(logits / T) with
                          kernels_pallas.sampling_utils.sample_from_probs keyed on
                          (seed, draft position, SALT_DRAFT).
  active   bool[N]        rows that draft (padding rows write nothing).
  inputs   i32[B, Q]      the step's own input tokens (the token at each pair's position):
                          a draft model's KV at p is built from the token at p, not p + 1.
Returned: drafts i32[N, K] (target vocab ids), probs f32[B, K, Vt] (the draft distribution
over the target vocab: one-hot at the draft for greedy rows), and the updated drafter KV.

Lookahead: EAGLE3/PEagle write K-1 positions past the bonus pair (last_pos + 1 ..
last_pos + K - 1); DFlash writes block_size positions starting at the bonus position
(last_pos + 1 .. last_pos + block_size). The scheduler must have reserved those slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.kv_cache import AttentionMetadata, KVCache, MixedMetadata
from kernels_pallas.sampling_utils import SALT_DRAFT, first_argmax, sample_from_probs


@struct.dataclass
class ProposeInputs:
    """What every drafter's proposal reads, as one pytree (see the module docstring)."""

    tokens: jax.Array  # i32[B, Q]      pair tokens (DFlash reads the bonus pair's only)
    aux: jax.Array  # f[B, Q, n*Ht]     target aux states at the pairs' positions
    meta: AttentionMetadata  # those Q positions in the drafter's cache
    last_idx: jax.Array  # i32[B]       index along Q of the bonus pair
    embed: jax.Array  # f[Vt, H]        the target's embeddings
    lm_head: jax.Array  # f[Vt, H]      the target's lm_head (DFlash without its own head)
    seeds: jax.Array  # i32[B]
    temperature: jax.Array  # f32[B]    0: greedy drafts
    active: jax.Array  # bool[N]        rows that draft (padding rows write nothing)
    inputs: jax.Array | None = None  # i32[B, Q]  the step's input tokens at the pairs' positions (draft models)


def slots_for(page_table, positions, valid, page_size: int, num_pages: int):
    """i32[B, Q] flat slots of ``positions`` [B, Q] through ``page_table`` [B, W]; invalid -> P*S (dropped)."""
    W = page_table.shape[1]
    page_idx = jnp.clip(positions // page_size, 0, W - 1)
    pages = jnp.take_along_axis(page_table, page_idx, axis=1)
    slots = pages * page_size + positions % page_size
    return jnp.where(valid, slots, num_pages * page_size).astype(jnp.int32)


def span_metadata(page_table, start, q_len: int, active, page_size: int, num_pages: int, causal: bool):
    """Metadata for q_len consecutive positions start[b] .. start[b] + q_len - 1 of each row.

    page_table: i32[B, W]; start: i32[B]; active: bool[B] (inactive rows: no writes, kv_lens 0).
    """
    B = page_table.shape[0]
    positions = start[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    valid = jnp.broadcast_to(active[:, None], (B, q_len))
    return AttentionMetadata(
        page_table=page_table,
        kv_lens=jnp.where(active, start + q_len, 0).astype(jnp.int32),
        positions=positions.astype(jnp.int32),
        slot_mapping=slots_for(page_table, positions, valid, page_size, num_pages),
        causal=jnp.full((B,), causal),
    )


def _pick(logits, temperature, seeds, positions, sample: bool):
    """logits f32[B, Vd]; temperature f32[B]; seeds i32[B]; positions i32[B] -> (ids i32[B], probs f32[B, Vd]).

    ``sample`` (static): False when every row drafts greedily (draft_sample_method "greedy":
    the engine passes temperature 0), so no softmax or draw over the vocabulary is traced for
    each draft position; the ids are the same argmax. probs is then None."""
    if not sample:
        return first_argmax(logits), None
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    probs = jax.nn.softmax(logits / t[:, None], axis=-1)
    sampled = sample_from_probs(probs, seeds, positions, SALT_DRAFT)
    argmax = first_argmax(logits)
    ids = jnp.where(greedy, argmax, sampled)
    onehot = jax.nn.one_hot(argmax, logits.shape[-1], dtype=jnp.float32)
    return ids, jnp.where(greedy[:, None], onehot, probs)


def _gather_rows(x, idx):
    """Each row's entry at ``idx``: x [B, Q, ...] (rows of a [B, Q] step) with idx i32[B]
    along Q, or x [1, T, ...] (a flat step's tokens) with idx i32[N] into T -> [B or N, ...]."""
    if x.shape[0] == 1:
        return x[0][idx]
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


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
    h = _gather_rows(h, last_idx)[:, None]  # [B, 1, H] pre-norm output at the bonus pair
    pos = _gather_rows(meta.positions, last_idx)  # i32[B]
    page_size, num_pages = kv.page_size, kv.num_pages
    drafts, probs = [], []
    for j in range(num_tokens):
        logits = drafter.apply(variables, h[:, 0], method=Eagle3Drafter.logits)  # [B, Vd]
        ids, p = _pick(logits, temperature, seeds, pos + 2 + j, with_probs)  # key: the draft's sequence position
        tok = drafter.apply(variables, ids, method=Eagle3Drafter.to_target_ids)
        drafts.append(tok)
        if with_probs:
            probs.append(drafter.apply(variables, p, method=Eagle3Drafter.probs_to_target))
        if j + 1 < num_tokens:
            step = span_metadata(meta.page_table, pos + j + 1, 1, active, page_size, num_pages, causal=True)
            h, kv = drafter.apply(variables, tok[:, None], h, step, kv, embed_table, hidden_is_fc_input=False)
    return jnp.stack(drafts, 1), (jnp.stack(probs, 1) if with_probs else None), kv


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
    pos = _gather_rows(meta.positions, last_idx)  # i32[N] position of the bonus pair
    variables = {"params": params}
    if M == 0:
        h, kv = drafter.apply(variables, tokens, aux, meta, kv, embed_table, hidden_is_fc_input=True)
        logits = drafter.apply(variables, _gather_rows(h, last_idx)[:, None], method=Eagle3Drafter.logits)
        return _finish(drafter, variables, logits, pos + 2, temperature, seeds, with_probs, Eagle3Drafter) + (kv,)
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
    rows = jnp.concatenate([_gather_rows(pairs_h, last_idx)[:, None], h[0, n_pairs:].reshape(N, M, -1)], 1)  # [N, K, H]
    logits = drafter.apply(variables, rows, method=Eagle3Drafter.logits)  # [B, K, Vd]
    return _finish(drafter, variables, logits, pos + 2, temperature, seeds, with_probs, Eagle3Drafter) + (kv,)


def _finish(drafter, variables, logits, first_pos, temperature, seeds, with_probs, cls):
    """Pick K drafts from logits f32[B, K, Vd]; draft k is the token at sequence position
    first_pos + k. Greedy drafts (``with_probs`` False) are one argmax over all K: K argmaxes
    of one position each were K pairs of small XLA reductions (DFlash's 15 over Qwen3's
    vocabulary: ~4.5 us each on an H100)."""
    if not with_probs:
        return drafter.apply(variables, first_argmax(logits), method=cls.to_target_ids), None
    ids, probs = zip(*(_pick(logits[:, k], temperature, seeds, first_pos + k, True) for k in range(logits.shape[1])))
    ids = drafter.apply(variables, jnp.stack(ids, 1), method=cls.to_target_ids)
    return ids, drafter.apply(variables, jnp.stack(probs, 1), method=cls.probs_to_target)


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
    bonus = _gather_rows(inp.tokens, last_idx)  # i32[B]: the bonus token, at position last_pos + 1
    c = drafter.cfg
    bs = c.block_size
    variables = {"params": params}
    kv = drafter.apply(variables, aux, meta, kv, method=DFlashDrafter.write_context)
    pos = _gather_rows(meta.positions, last_idx) + 1  # i32[B] block start = bonus position
    block = span_metadata(meta.page_table, pos, bs, active, kv.page_size, kv.num_pages, causal=False)
    B = bonus.shape[0]
    tokens = jnp.concatenate([bonus[:, None], jnp.full((B, bs - 1), c.mask_token_id, bonus.dtype)], 1)
    h, kv = drafter.apply(variables, tokens, block, kv, embed_table)
    n = bs - 1 if num_tokens is None else min(num_tokens, bs - 1)
    logits = drafter.apply(variables, h[:, 1:1 + n], target_lm_head, method=DFlashDrafter.logits)  # [B, K, V]
    return _finish(drafter, variables, logits, pos + 1, temperature, seeds, with_probs, DFlashDrafter) + (kv,)
