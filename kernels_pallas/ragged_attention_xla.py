"""Ragged paged attention through XLA for the CPU (the contract of ragged_paged_attention.py).

The reference there gathers every token's keys ([T, W * S, KVH, D]): a prefill chunk of
256 tokens over a 4096-token table is half a gigabyte of gathered keys per layer, so it is a
test oracle, not a path to serve on. This one loops instead, with traced trip counts, so
its work follows the step's real tokens and keys, not its buckets:
  - over the sequences present (``num_seqs``), each taking a window of its queries: the
    ``short`` window (a decode token, K + 1 tokens to verify) or, for a longer segment, the
    ``long`` one (a prefill chunk), chosen per sequence by ``lax.cond``;
  - within a sequence, over blocks of ``block_kv`` keys up to its kv_len, read through its
    page table, with an online softmax.
On a CPU the loops and conds cost nothing; on a GPU a conditional reads its predicate on
the host (a sync per sequence), so accelerators take the kernels, or the reference where a
kernel cannot take a shape (jspec.ops.attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.ragged_paged_attention import NEG_INF, validate


def _window(q, positions, k_pages, v_pages, sinks, page_table_row, kv_len, q_len, causal, start, out, *, width: int,
            block_kv: int, sm_scale: float, window: int):
    """Attention of the ``width`` queries from ``start`` (rows past q_len are left as they
    were in ``out``) over this sequence's keys, block by block up to kv_len (from the first
    block a query's sliding ``window`` reaches)."""
    _, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    G = H // KVH
    qs = lax.dynamic_slice_in_dim(q, start, width).reshape(width, KVH, G, D).astype(jnp.float32) * sm_scale
    j = jnp.arange(width, dtype=jnp.int32)
    pos = lax.dynamic_slice_in_dim(positions, start, width)  # [width] each query's position
    last = jnp.where(causal, jnp.minimum(pos, kv_len - 1), kv_len - 1)  # last key each sees
    pages_per_block = block_kv // S
    table = jnp.clip(page_table_row, 0, P - 1)

    def body(b, carry):
        m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(jnp.pad(table, (0, pages_per_block)), b * pages_per_block, pages_per_block)
        k = k_pages[ids].reshape(block_kv, KVH, D).astype(jnp.float32)
        v = v_pages[ids].reshape(block_kv, KVH, D).astype(jnp.float32)
        key = b * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        seen = key[None, :] <= last[:, None]  # [width, block]
        if window:
            seen = seen & (key[None, :] > last[:, None] - window)
        s = jnp.einsum("qhgd,khd->qhgk", qs, k)
        s = jnp.where(seen[:, None, None, :], s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(seen[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        v = jnp.where((key < kv_len)[:, None, None], v, 0.0)  # pages past kv_len may hold NaN
        acc = acc * scale[..., None] + jnp.einsum("qhgk,khd->qhgd", p, v)
        return m_new, l * scale + jnp.sum(p, axis=-1), acc

    init = (jnp.full((width, KVH, G), NEG_INF, jnp.float32), jnp.zeros((width, KVH, G), jnp.float32),
            jnp.zeros((width, KVH, G, D), jnp.float32))
    n_blocks = (jnp.maximum(kv_len, 0) + block_kv - 1) // block_kv
    first = 0
    if window:  # blocks wholly before every query's window are skipped
        lowest = jnp.min(jnp.where(j < q_len, last, kv_len)) - window + 1
        first = jnp.clip(lowest, 0, None) // block_kv
    m, l, acc = lax.fori_loop(first, n_blocks, body, init)
    if sinks is not None:  # each head's sink joins the denominator (paged_attention.softmax_with_sinks)
        sink = sinks.astype(jnp.float32).reshape(KVH, G)[None]
        m_all = jnp.maximum(m, sink)
        scale = jnp.exp(m - m_all)
        l, acc = l * scale + jnp.exp(sink - m_all), acc * scale[..., None]
    o = (acc / jnp.where(l == 0, 1.0, l)[..., None]).reshape(width, H, D).astype(out.dtype)
    keep = (j < q_len)[:, None, None]
    return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o, lax.dynamic_slice_in_dim(out, start, width)),
                                           start, 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "short", "long", "block_kv", "window"))
def ragged_attention_xla(
    q,  # [T, H, D]
    k_pages,  # [P, S, KVH, D]
    v_pages,  # [P, S, KVH, D]
    cu_q_lens,  # i32[N + 1]
    kv_lens,  # i32[N]
    page_table,  # i32[N, W]
    num_seqs,  # i32[1]
    causal=None,  # bool[N] | None
    positions=None,  # i32[T] | None: each query's position (None: the contract's kv_len - q_len + j)
    sinks=None,  # f32[H] | None: attention sinks (the reference's)
    *,
    sm_scale: float,
    window: int = 0,  # > 0: sliding window (the reference's)
    short: int,  # query window of short segments (decode, verification): >= their q_len
    long: int,  # query window of the longer ones (prefill chunks): >= every q_len
    block_kv: int | None = None,  # keys per inner step (a multiple of page_size; None: 8 pages)
):  # -> [T, H, D] in q.dtype
    """The contract of ``ragged_paged_attention`` (same arguments) for the CPU: a segment
    longer than ``long`` queries is not supported (its later queries are left at 0).
    ``positions`` given: query t sits at positions[t] (causal: it sees keys up to there and
    below kv_len), which also serves rows of a fixed width whose last tokens are padding (a
    decode step's [N, K + 1] rows, RaggedMetadata.uniform)."""
    validate(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal)
    T = q.shape[0]
    N, W = page_table.shape
    S = k_pages.shape[1]
    short, long = max(1, min(short, long)), max(1, long)
    block_kv = block_kv or 8 * S
    if block_kv % S:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={S}")
    causal = jnp.ones((N,), bool) if causal is None else causal
    cu = cu_q_lens.astype(jnp.int32)
    kv = jnp.clip(kv_lens.astype(jnp.int32), 0, W * S)
    if positions is None:
        from kernels_pallas.ragged_paged_attention import token_layout

        seq, _ = token_layout(cu, kv, num_seqs, None, T, W * S)
        positions = kv[seq] - (cu[seq + 1] - cu[seq]) + (jnp.arange(T, dtype=jnp.int32) - cu[seq])
    qp = jnp.pad(q, ((0, long), (0, 0), (0, 0)))  # every window stays inside, its rows past T dropped
    pp = jnp.pad(positions.astype(jnp.int32), (0, long))
    win = functools.partial(_window, qp, pp, k_pages, v_pages, sinks, block_kv=block_kv, sm_scale=sm_scale,
                            window=window)

    def seq(i, out):
        q_len = cu[i + 1] - cu[i]
        args = (page_table[i], kv[i], q_len, causal[i], cu[i], out)
        if short == long:
            return win(*args, width=long)
        return lax.cond(q_len <= short, functools.partial(win, width=short), functools.partial(win, width=long),
                        *args)

    n = jnp.clip(num_seqs.astype(jnp.int32)[0], 0, N)
    out = lax.fori_loop(0, n, seq, jnp.zeros(qp.shape, q.dtype))
    return out[:T]
