"""Ragged paged attention over a flat token batch for TPUs: a Mosaic TPU Pallas kernel.

Contract: ragged_paged_attention.py. Tested on CPU with ``interpret=pltpu.InterpretParams()``
and lowered for v5e / v6e (tests/kernels/test_lowering.py); not yet run on a TPU.

Design (the layout of jax's pallas/ops/tpu/ragged_paged_attention, written smaller):
- Grid over aligned blocks of ``block_q`` tokens of the flat axis. A block may span several
  sequences (decode tokens, the tail of one chunk and the head of the next): the program
  walks the sequences that own its real tokens, one after another, and runs the online
  softmax of every row against each; a row's mask admits only its own sequence's keys, so
  each row's softmax state sees exactly its sequence. Aligned blocks let Pallas' pipeline
  fetch q and write the output with plain BlockSpecs, every row written once (padding
  rows: 0), and no program ever writes a row it does not own.
  Why not one program per (sequence, q block) as on the GPU: v5e / v6e run the grid one
  step after another on one TensorCore, so there is no parallelism to gain from the split,
  and unaligned q blocks would need a manual q DMA and masked output stores.
- Rows: the wrapper lays q out per kv head, [KVH, T * G, D] (row = token * G + g, as
  paged_attention_tpu.py), so each kv head is one [block_q * G, D] x [D, keys] matmul on
  the MXU; a row's sequence and last visible key come from the wrapper too
  (ragged_paged_attention.token_layout), as [rows, 1] blocks.
- K/V pages stay in HBM (memory_space ANY) and are DMAed by hand, ``pages_per_block`` whole
  pages [S, KVH, D] per step, double-buffered: the pages of the next (sequence, kv step) of
  the program are in flight while the current ones are used, across sequence boundaries.
  Pages past the last key a sequence's rows see are not fetched. All kv heads use each
  page once it is in VMEM, so GQA and multi-token segments do not multiply the bytes read.
- Scalars in SMEM by scalar prefetch: cu_q_lens, kv_lens, causal (i32), the flattened page
  table (2-D SMEM arrays pad their rows) and each block's first and last sequence.
- NaN safety: junk pages, stale buffer slots and keys past kv_len are masked in the scores
  with ``where`` and zeroed in V before the PV matmul; rows that see no key output 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.paged_attention_tpu import unsupported_shape as unsupported_shape  # D: 128 lanes
from kernels_pallas.ragged_paged_attention import NEG_INF, token_layout


def validate_tpu(q, k_pages, *, block_q, pages_per_block):
    """Trace-time checks for the Mosaic TPU tiling this kernel relies on."""
    D = q.shape[-1]
    G = q.shape[1] // k_pages.shape[2]
    if unsupported_shape(D):
        raise ValueError(f"head_dim must be a multiple of 128 (TPU lanes), got {D}")
    if q.dtype != k_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_pages.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dtype must be f32 or bf16, got {q.dtype}")
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    if block_q is not None and (block_q < 1 or block_q * G % 16):
        raise ValueError(f"block_q * (num_heads / kv_heads) must be a positive multiple of 16 "
                         f"(bf16 sublane tiles), got block_q={block_q} with {G} heads per kv head")


def default_block_q(num_tokens: int, group: int) -> int:
    """About 128 rows (the MXU's height on v5e) per block, a multiple of 16 rows, and no
    more tokens than the step has (rounded to that multiple)."""
    step = 16 // math.gcd(16, group)  # tokens per 16 rows
    bq = -(-max(1, 128 // group) // step) * step
    return min(bq, -(-num_tokens // step) * step)


def _kernel(
    # scalar prefetch (SMEM)
    cu_ref,  # i32[N + 1]
    kv_lens_ref,  # i32[N], clipped to [0, W * S]
    causal_ref,  # i32[N], 0: non-causal
    pt_ref,  # i32[N * W], clipped to [0, P)
    blk_lo_ref,  # i32[num_blocks]: first sequence with a visible key in the block
    blk_hi_ref,  # i32[num_blocks]: last such sequence (< blk_lo: none)
    # blocks (VMEM)
    q_ref,  # [KVH, R, D], R = block_q * G
    row_seq_ref,  # i32[R, 1]: each row's sequence (-1: padding)
    row_last_ref,  # i32[R, 1]: each row's last visible key (-1: none)
    k_hbm,  # [P, S, KVH, D] in HBM
    v_hbm,
    o_ref,  # [KVH, R, D]
    # scratch
    k_buf,  # [2, ppb, S, KVH, D]
    v_buf,
    sems,  # DMA semaphores [2 (k, v), 2 (buffer)]
    m_sc,  # f32[KVH, R, 1] running max
    l_sc,  # f32[KVH, R, 1] running denominator
    acc_sc,  # f32[KVH, R, D] unnormalised output
    *,
    sm_scale: float,
    block_q: int,
    table_width: int,
):
    qb = pl.program_id(0)
    _, ppb, S, KVH, D = k_buf.shape
    bk = ppb * S
    W = table_width
    blk_end = (qb + 1) * block_q  # tokens of this block: [qb * block_q, blk_end)

    def seq_end(s):
        """1 + the last key any row of sequence s in this block sees (<= kv_len)."""
        q_start, q_end, kv = cu_ref[s], cu_ref[s + 1], kv_lens_ref[s]
        causal_end = kv - (q_end - q_start) + jnp.minimum(q_end, blk_end) - q_start
        return jnp.clip(jnp.where(causal_ref[s] != 0, causal_end, kv), 0, kv)

    def num_steps(s):
        return jnp.maximum(1, (seq_end(s) + bk - 1) // bk)  # >= 1: keeps the DMA chain simple

    def copies(s, j, buf):
        """(predicate, K copy, V copy) per page of kv step j of sequence s into buffer buf;
        pages past the last needed one are not fetched (their keys are masked)."""
        last_slot = jnp.minimum((seq_end(s) + S - 1) // S - 1, W - 1)
        out = []
        for i in range(ppb):
            slot = j * ppb + i
            page = pt_ref[s * W + jnp.clip(slot, 0, W - 1)]
            out.append((slot <= last_slot,
                        pltpu.make_async_copy(k_hbm.at[page], k_buf.at[buf, i], sems.at[0, buf]),
                        pltpu.make_async_copy(v_hbm.at[page], v_buf.at[buf, i], sems.at[1, buf])))
        return out

    def dma(op, s, j, buf):  # op: "start" | "wait", on the copies of (s, j) that are needed
        for needed, ck, cv in copies(s, j, buf):
            def go(ck=ck, cv=cv):
                getattr(ck, op)()
                getattr(cv, op)()

            pl.when(needed)(go)

    def compute(s, j, buf):
        t_row = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # key index, lane-major
        t_col = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)  # key index, sublane-major
        mask = (row_seq_ref[...] == s) & (t_row <= row_last_ref[...])  # [R, bk]; last < kv_len
        v_ok = t_col < seq_end(s)  # [bk, 1]: unfetched slots and junk keys lie past it
        for h in range(KVH):  # static: every kv head uses the resident pages
            k = jnp.concatenate([k_buf[buf, i, :, h, :] for i in range(ppb)], axis=0)  # [bk, D]
            v = jnp.concatenate([v_buf[buf, i, :, h, :] for i in range(ppb)], axis=0)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))  # 0 * NaN = NaN: zero, don't multiply
            sc = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            sc = jnp.where(mask, sc * sm_scale, NEG_INF)
            m_prev = m_sc[h]
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)  # rows of other sequences: p = 0, alpha = 1
            alpha = jnp.exp(m_prev - m_new)
            l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            acc_sc[h] = alpha * acc_sc[h] + pv
            m_sc[h] = m_new

    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    lo, hi = blk_lo_ref[qb], blk_hi_ref[qb]

    @pl.when(lo <= hi)
    def _run():
        dma("start", lo, 0, 0)

        def body(carry):
            s, j, buf = carry
            last = j + 1 >= num_steps(s)
            s_next = jnp.where(last, s + 1, s)
            j_next = jnp.where(last, 0, j + 1)

            @pl.when(s_next <= hi)
            def _prefetch():
                dma("start", s_next, j_next, 1 - buf)

            dma("wait", s, j, buf)
            compute(s, j, buf)
            return s_next, j_next, 1 - buf

        lax.while_loop(lambda c: c[0] <= hi, body, (lo, jnp.int32(0), jnp.int32(0)))

    l = l_sc[...]
    o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block", "interpret"))
def ragged_paged_attention_tpu(
    q,  # [T, H, D] f32 | bf16, D a multiple of 128
    k_pages,  # [P, S, KVH, D] same dtype as q
    v_pages,  # [P, S, KVH, D]
    cu_q_lens,  # i32[N + 1]
    kv_lens,  # i32[N]
    page_table,  # i32[N, W]
    num_seqs,  # i32[1]
    causal=None,  # bool[N] | None
    *,
    sm_scale: float,
    block_q: int | None = None,  # tokens per block; block_q * G a multiple of 16 (None: default_block_q)
    pages_per_block: int = 8,  # pages DMAed per kv step (keys per step = pages_per_block * S)
    interpret: bool = False,  # True: pltpu.InterpretParams() (TPU semantics on CPU)
):  # -> [T, H, D] in q.dtype
    validate_tpu(q, k_pages, block_q=block_q, pages_per_block=pages_per_block)
    T, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    N, W = page_table.shape
    G = H // KVH
    bq = block_q or default_block_q(T, G)
    nblk = -(-T // bq)
    T_pad = nblk * bq
    R = bq * G
    ppb = min(pages_per_block, W)

    seq, last = token_layout(cu_q_lens, kv_lens, num_seqs, causal, T, W * S)  # i32[T] each
    seq = jnp.where(last >= 0, seq, -1)  # tokens that see nothing belong to no sequence's walk
    seq = jnp.pad(seq, (0, T_pad - T), constant_values=-1)
    last = jnp.pad(last, (0, T_pad - T), constant_values=-1)
    blk_seq = seq.reshape(nblk, bq)
    blk_lo = jnp.min(jnp.where(blk_seq >= 0, blk_seq, N), axis=1)
    blk_hi = jnp.max(blk_seq, axis=1)
    row_seq = jnp.repeat(seq, G)[:, None]  # [T_pad * G, 1], row = token * G + g
    row_last = jnp.repeat(last, G)[:, None]
    qr = q.reshape(T, KVH, G, D).transpose(1, 0, 2, 3).reshape(KVH, T * G, D)
    qr = jnp.pad(qr, ((0, 0), (0, (T_pad - T) * G), (0, 0)))

    scalars = (
        cu_q_lens.astype(jnp.int32),
        jnp.clip(kv_lens.astype(jnp.int32), 0, W * S),  # the reference sees W * S keys at most
        jnp.ones((N,), jnp.int32) if causal is None else causal.astype(jnp.int32),
        jnp.clip(page_table.astype(jnp.int32), 0, P - 1).reshape(N * W),  # junk entries: any value
        blk_lo.astype(jnp.int32),
        blk_hi.astype(jnp.int32),
    )
    rows = pl.BlockSpec((R, 1), lambda b, *_: (b, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(nblk,),
        in_specs=[pl.BlockSpec((KVH, R, D), lambda b, *_: (0, b, 0)), rows, rows, hbm, hbm],
        out_specs=pl.BlockSpec((KVH, R, D), lambda b, *_: (0, b, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, ppb, S, KVH, D), k_pages.dtype),
            pltpu.VMEM((2, ppb, S, KVH, D), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((KVH, R, 1), jnp.float32),
            pltpu.VMEM((KVH, R, 1), jnp.float32),
            pltpu.VMEM((KVH, R, D), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, block_q=bq, table_width=W),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((KVH, T_pad * G, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"ragged_paged_attention_tpu_q{bq}_p{ppb}",
    )(*scalars, qr, row_seq, row_last, k_pages, v_pages)
    return out[:, : T * G].reshape(KVH, T, G, D).transpose(1, 0, 2, 3).reshape(T, H, D)
