"""Ragged paged attention for TPUs: a Mosaic TPU Pallas kernel with scalar-prefetched pages.

Same contract as ``ref_paged_attention`` in paged_attention.py. Tested on CPU with
``interpret=pltpu.InterpretParams()``; not yet run on a TPU (none was available).

Design:
- ``PrefetchScalarGridSpec`` puts the page table (flattened to 1-D: 2-D SMEM arrays pad
  their rows), kv_lens and each sequence's last visible key in SMEM before the grid runs,
  so the K/V BlockSpec index maps can look up page ids: Pallas' pipeline then DMAs the
  next pages while the current ones are being used.
- Grid (batch, row_block, kv_step). One kv step covers ``pages_per_block`` pages, each
  delivered by its own BlockSpec (a block is one whole page [S, KVH, D]: its last two dims
  are the full (KVH, D), which satisfies the (8, 128) tiling rule for any KVH). Every page
  is DMAed once per (sequence, row block) and used by all kv heads and all query rows,
  so GQA and multi-token verification do not multiply the K/V bytes read.
- Rows of a kv head are all its G query heads times all query tokens (r = token * G + g),
  a [rows, D] x [D, keys] matmul on the MXU per kv head; online softmax state lives in
  VMEM scratch across the "arbitrary" kv axis.
- Steps past a sequence's last visible key repeat the previous page index (Pallas skips
  the DMA when a block index does not change) and skip the compute (pl.when).
- Keys at or past kv_len may be NaN (junk pages): scores are masked with ``where`` and V
  rows are zeroed before the PV matmul; rows that see no key output 0, as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30  # finite: exp(NEG_INF - NEG_INF) stays defined for rows with no key yet
NONCAUSAL_POS = 2**30  # row position of DFlash rows: sees every key below kv_len


def unsupported_shape(head_dim: int) -> str | None:
    """Why the Mosaic kernel cannot take this head_dim (it tiles D by 128 lanes), or None."""
    return f"head_dim {head_dim} is not a multiple of 128" if head_dim % 128 else None


def validate_tpu(q, k_pages, *, pages_per_block, block_rows):
    """Trace-time checks for the Mosaic TPU tiling this kernel relies on."""
    D = q.shape[-1]
    if unsupported_shape(D):
        raise ValueError(f"head_dim must be a multiple of 128 (TPU lanes), got {D}")
    if q.dtype != k_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_pages.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dtype must be f32 or bf16, got {q.dtype}")
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    if block_rows is not None and block_rows % 16:
        raise ValueError(f"block_rows must be a multiple of 16 (bf16 sublane tiles), got {block_rows}")


def group_queries(q, positions, causal, kv_heads, rows_padded):
    """[B, Q, H, D] queries -> [B, KVH, R_pad, D] rows (r = token * G + g) + row positions.

    (The GPU kernel gathers the same rows in-kernel instead; on TPU the BlockSpec pipeline
    wants them contiguous.)

    Returns (q_rows [B, KVH, R_pad, D], row_pos i32[B, R_pad]). Padding rows get -1 (no
    visible key); DFlash (non-causal) rows get NONCAUSAL_POS.
    """
    B, Q, H, D = q.shape
    G = H // kv_heads
    R = Q * G
    qr = q.reshape(B, Q, kv_heads, G, D).transpose(0, 2, 1, 3, 4).reshape(B, kv_heads, R, D)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_padded - R), (0, 0)))
    pos = positions.astype(jnp.int32)
    if causal is not None:
        pos = jnp.where(causal[:, None], pos, NONCAUSAL_POS)
    row_pos = jnp.repeat(pos, G, axis=1)  # [B, R]: row r belongs to token r // G
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_padded - R)), constant_values=-1)
    return qr, row_pos


def ungroup_rows(o_rows, Q, H):
    """[B, KVH, R_pad, D] -> [B, Q, H, D] (inverse of group_queries)."""
    B, KVH, _, D = o_rows.shape
    G = H // KVH
    o = o_rows[:, :, : Q * G].reshape(B, KVH, Q, G, D).transpose(0, 2, 1, 3, 4)
    return o.reshape(B, Q, H, D)


def _kernel(
    # scalar prefetch (SMEM)
    pt_ref,  # i32[B * W] flattened page table
    kv_lens_ref,  # i32[B]
    kv_end_ref,  # i32[B]: 1 + last key any row of the sequence can see (<= kv_len)
    # blocks (VMEM)
    q_ref,  # [KVH, block_rows, D]
    row_pos_ref,  # i32[block_rows, 1]: last visible position per row (-1: padding)
    *refs,  # k pages x ppb [S, KVH, D], v pages x ppb, o [KVH, block_rows, D], scratch
    sm_scale: float,
    pages_per_block: int,
):
    ppb = pages_per_block
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * ppb :]
    b, j = pl.program_id(0), pl.program_id(2)
    S, KVH, D = k_refs[0].shape
    bk = ppb * S

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    start = j * bk
    kv_len = kv_lens_ref[b]

    @pl.when(start < kv_end_ref[b])
    def _step():
        t_row = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # key index, lane-major
        t_col = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)  # key index, sublane-major
        mask = (t_row < kv_len) & (t_row <= row_pos_ref[...])  # [block_rows, bk]
        v_ok = t_col < kv_len  # [bk, 1]
        for h in range(KVH):  # static: KVH matmuls over the same resident pages
            k = jnp.concatenate([k_refs[i][:, h, :] for i in range(ppb)], axis=0)  # [bk, D]
            v = jnp.concatenate([v_refs[i][:, h, :] for i in range(ppb)], axis=0)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))  # junk V may be NaN: 0 * NaN = NaN
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = jnp.where(mask, s * sm_scale, NEG_INF)
            m_prev = m_sc[h]  # [block_rows, 1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            acc_sc[h] = alpha * acc_sc[h] + pv
            m_sc[h] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "block_rows", "interpret"))
def paged_attention_tpu(
    q,  # [B, Q, H, D] f32 | bf16, D a multiple of 128
    k_pages,  # [P, S, KVH, D] same dtype as q
    v_pages,  # [P, S, KVH, D]
    page_table,  # i32[B, W]; entries past a sequence's pages: any id in [0, P)
    kv_lens,  # i32[B]; keys valid per sequence (0 = empty slot)
    positions,  # i32[B, Q]; position of each query token (causal rows)
    causal=None,  # bool[B] | None; False = DFlash block (sees all kv_lens keys)
    *,
    sm_scale: float,
    pages_per_block: int = 8,  # pages DMAed per grid step (keys per step = ppb * S)
    block_rows: int | None = None,  # query rows per kv head per program; multiple of 16
    interpret: bool = False,  # True: pltpu.InterpretParams() (TPU semantics on CPU)
):  # -> [B, Q, H, D] in q.dtype
    validate_tpu(q, k_pages, pages_per_block=pages_per_block, block_rows=block_rows)
    B, Q, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    W = page_table.shape[1]
    R = Q * H // KVH
    if block_rows is None:
        block_rows = min(-(-R // 16) * 16, 256)
    R_pad = -(-R // block_rows) * block_rows
    ppb = min(pages_per_block, W)
    num_steps = -(-W // ppb)

    qr, row_pos = group_queries(q, positions, causal, KVH, R_pad)  # [B,KVH,R_pad,D], i32[B,R_pad]
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), W * S)  # the reference sees W * S keys at most
    # Last key any row can see: prefill rows see less than kv_len; skip steps past it.
    kv_end = jnp.minimum(kv_lens, jnp.max(row_pos, axis=1) + 1)
    pt = page_table.astype(jnp.int32).reshape(-1)

    def page_spec(i):
        def index_map(b, r, j, pt_ref, kv_lens_ref, kv_end_ref):
            # Past the last needed page, keep fetching that same page: an unchanged block
            # index costs no DMA. Empty sequences fetch their first entry (any id in range).
            last = jnp.maximum((kv_end_ref[b] + S - 1) // S - 1, 0)
            slot = jnp.minimum(jnp.minimum(j * ppb + i, last), W - 1)
            return pt_ref[b * W + slot], 0, 0, 0

        return pl.BlockSpec((None, S, KVH, D), index_map)

    in_specs = [
        pl.BlockSpec((None, KVH, block_rows, D), lambda b, r, j, *_: (b, 0, r, 0)),
        pl.BlockSpec((None, block_rows, 1), lambda b, r, j, *_: (b, r, 0)),
        *[page_spec(i) for i in range(ppb)],
        *[page_spec(i) for i in range(ppb)],
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, R_pad // block_rows, num_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, KVH, block_rows, D), lambda b, r, j, *_: (b, 0, r, 0)),
        scratch_shapes=[
            pltpu.VMEM((KVH, block_rows, 1), jnp.float32),  # running max
            pltpu.VMEM((KVH, block_rows, 1), jnp.float32),  # running denominator
            pltpu.VMEM((KVH, block_rows, D), jnp.float32),  # unnormalised output
        ],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, pages_per_block=ppb),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, KVH, R_pad, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"paged_attention_tpu_p{ppb}_r{block_rows}",
    )(pt, kv_lens, kv_end, qr, row_pos[..., None], *([k_pages] * ppb), *([v_pages] * ppb))
    return ungroup_rows(out, Q, H)
