"""What every method's draft proposal reads (``ProposeInputs``) and the helpers they share;
each method's propose function lives in its own module (``Method.propose``).

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
K = 0 (``no_drafts``): the cache written for the step's pairs, nothing proposed: a decode
step that verifies no drafts (dynamic speculation's width 1) keeps the drafter's cache
whole, so its later proposals read every position (vLLM V0 ran its proposer on such steps
for the same reason).

Lookahead: each method's ``Method.lookahead`` says how many slots past the step's last
verified token its proposal writes (EAGLE3/PEagle K - 1 past the bonus pair; DFlash its
block_size positions from the bonus position on). The scheduler must have reserved them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec.kv_cache import AttentionMetadata, KVCache
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


def create_kv_cache(cfg, num_pages: int, page_size: int, dtype, sharding=None) -> KVCache:
    """The drafter's own cache (``cfg``: its DrafterConfig): num_layers x [P, S, KVH, D],
    the same page ids as the target's page table, its own buffers."""
    return KVCache.create(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, sharding)


def no_drafts(n: int, cache):
    """A proposal of K = 0 for n rows (the module docstring): (i32[n, 0], None, cache)."""
    return jnp.zeros((n, 0), jnp.int32), None, cache


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


def pick(logits, temperature, seeds, positions, sample: bool):
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


def gather_rows(x, idx):
    """Each row's entry at ``idx``: x [B, Q, ...] (rows of a [B, Q] step) with idx i32[B]
    along Q, or x [1, T, ...] (a flat step's tokens) with idx i32[N] into T -> [B or N, ...]."""
    if x.shape[0] == 1:
        return x[0][idx]
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def pick_drafts(drafter, variables, logits, first_pos, temperature, seeds, with_probs, cls):
    """(drafts i32[B, K] target ids, probs f32[B, K, Vt] | None): K drafts picked from logits
    f32[B, K, Vd]; draft k is the token at sequence position first_pos + k (i32[B]). ``cls``:
    the drafter's module class, whose ``to_target_ids`` / ``probs_to_target`` (DraftVocab)
    map the draft vocabulary into the target's. Greedy drafts (``with_probs`` False) are one argmax over all K: K argmaxes
    of one position each were K pairs of small XLA reductions (DFlash's 15 over Qwen3's
    vocabulary: ~4.5 us each on an H100)."""
    if not with_probs:
        return drafter.apply(variables, first_argmax(logits), method=cls.to_target_ids), None
    ids, probs = zip(*(pick(logits[:, k], temperature, seeds, first_pos + k, True) for k in range(logits.shape[1])))
    ids = drafter.apply(variables, jnp.stack(ids, 1), method=cls.to_target_ids)
    return ids, drafter.apply(variables, jnp.stack(probs, 1), method=cls.probs_to_target)
