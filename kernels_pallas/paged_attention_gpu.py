"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel on the Triton backend.

Same contract as ``ref_paged_attention`` in paged_attention.py (layout, masking, a zero
output for rows that see no key). One kernel serves decode (Q = 1), causal verification
(Q = K + 1), DFlash blocks (causal[b] = False) and prefill chunks.

Why the Triton backend and not Mosaic GPU: Mosaic GPU (the default GPU lowering since
jax 0.9, preferred by issue 7) moves data with TMA/bulk copies of rectangular blocks, so
a paged kernel there issues one copy per page (page ids read from SMEM) in a
warp-specialised pipeline; that is a larger kernel than this issue's time allowed, and
it could not be tested on our CPU machines beyond interpret mode. The
Triton backend is deprecated in jax 0.11 but present and working there (seen on the H200,
2026-11-21): a pointer gather over per-token page ids turns the page table into ordinary
(coalesced: one 2*D-byte row per token and head) loads that Triton software-pipelines.
Revisit with ``plgpu.kernel`` once the Triton backend is removed.

Design (flash-decoding, GQA-packed):
- Grid (batch, kv_head, row_block, kv_split). The "rows" of one program are all query
  tokens of one sequence times all G = H / KVH query heads sharing its kv head
  (row r = q_token * G + g), so each K/V page is read once per kv head no matter how
  many query tokens (verification) or heads (GQA) use it: verifying 8 tokens reads the
  same bytes as decoding one.
- Each program runs an online softmax over blocks of ``block_kv`` tokens in its split of
  the sequence; splits of the kv range fill the GPU when batch * kv_heads is small
  (batch 1 decode has 8 programs per split). A second small Pallas kernel merges the
  splits (one launch; the jnp combine compiled to 3-4 XLA fusions of ~1 us each).
- Causality is folded into a per-row "last visible position": positions for causal rows,
  a huge value for DFlash rows, -1 for padding rows; a key j is visible to row r iff
  j < kv_len and j <= row_pos[r]. A program skips kv blocks past its rows' largest
  position, so prefill chunks do not stream keys they cannot see.
- Keys at or past kv_len (the tail of the last page, whole junk pages a split covers)
  may be NaN: scores are masked with ``where`` and V rows are zeroed before the dot,
  so no NaN reaches the accumulators (0 * NaN would). Only blocks that reach kv_len or a
  row's causal diagonal pay for the masks; interior blocks hold valid keys every real row
  sees, and run unmasked.
- Queries are gathered and outputs scattered by row index inside the kernel (no
  transposes around the call): at batch 1 each extra XLA op is a launch costing about as
  much as the attention itself.

Measured on the H200 (2026-11-21, jax 0.11.2, scripts/bench_attention.py): decode at batch
32, context 4096, 32/8 heads, D 128, bf16, page 16: 152-180 us, 3.0-3.5 TB/s of KV read,
76-90% of the best bandwidth measured in the same run (jnp reference: 557-562 us). At
batch 1 (16.8 MB of KV) a call is latency-bound; by profiler GPU time (2026-11-21):
decode 9.6 us (kernel 7.8 + combine 1.8), verify-8 11.9 us (kernel 9.5 + combine 2.4),
ratio 1.24; the 2.3 us difference is the 32-row tile's compute (~1.0 us: a 16-row tile with
the same keys was 1.0 us faster), the 8x larger split partials written (~0.5 us) and
combined (~0.6 us).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.paged_attention import kv_compute_dtype, kv_read
from kernels_pallas.tuning import device_tuning

NEG_INF = -1e30  # finite "minus infinity": exp(NEG_INF - NEG_INF) stays defined
NONCAUSAL_POS = 2**30  # row position of DFlash rows: sees every key below kv_len
MAX_COMBINE_SPLITS = 64  # the combine kernel holds [splits (pow2), D] per program in registers


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unsupported_shape(head_dim: int) -> str | None:
    """Why the Triton kernel cannot take this head_dim (its dot tiles are powers of 2
    >= 16), or None. The engine then runs the XLA path instead (jspec.ops.attention)."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of 2 >= 16"
    return None


def validate_gpu(q, k_pages, *, block_rows, block_kv, kv_splits, split_combine="kernel"):
    """Trace-time checks for what the Triton lowering needs (power-of-2 tiles)."""
    D = q.shape[-1]
    if unsupported_shape(D):
        raise ValueError(f"head_dim must be a power of 2 >= 16 for the Triton kernel, got {D}")
    if q.dtype != kv_compute_dtype(q.dtype, k_pages.dtype):  # an FP8 cache: any q dtype (read into it)
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_pages.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype must be f32, bf16 or f16, got {q.dtype}")
    for name, v in (("block_rows", block_rows), ("block_kv", block_kv)):
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"{name} must be a power of 2 >= 16 (Triton dot tiles), got {v}")
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    if split_combine not in ("kernel", "jnp"):
        raise ValueError(f"split_combine must be 'kernel' or 'jnp', got {split_combine!r}")


def _kernel(
    # inputs (whole arrays in global memory; each program gathers what it needs)
    kv_lens_ref,  # i32[B]
    *refs,  # [causal_ref bool[B]] pt_ref i32[B*W], pos_ref i32[B*Q], q_ref [N, D], k_ref, v_ref, outputs
    sm_scale: float,
    page_size: int,
    kv_heads: int,
    group: int,  # G = H / KVH
    q_len: int,  # Q
    table_width: int,  # W
    block_rows: int,
    block_kv: int,
    tokens_per_split: int,  # the most keys of one split (W * S over the splits)
    splits: int,  # kv_splits
    has_causal: bool,
    has_sinks: bool = False,  # gpt-oss: sinks_ref [H] after v_ref (one split: joined here; more: in the combine)
    window: int = 0,  # gpt-oss's sliding layers: a row sees the window keys up to its last
):
    # refs: pt_ref i32[B * W] (flattened page table), pos_ref i32[B * Q], q_ref [N = B*Q*H, D],
    # k_ref/v_ref [P * S * KVH, D] (row = (page * S + slot) * KVH + head), [sinks_ref], then outputs:
    # o_ref [N + 1, D] (single split) or, per split, o_ref [N + 1, D] (this split's
    # normalised output, in split_dtype) and lse_ref f32[N + 1] (its log-sum-exp).
    # Row N is a trash row that padding rows write to: the
    # interpreter cannot discharge masked stores, so padding rows are redirected instead.
    causal_ref, refs = (refs[0], refs[1:]) if has_causal else (None, refs)
    pt_ref, pos_ref, q_ref, k_ref, v_ref, *out_refs = refs
    sinks_ref = out_refs.pop(0) if has_sinks else None
    b = pl.program_id(0)
    h = pl.program_id(1)
    rb = pl.program_id(2)
    split = pl.program_id(3)
    N = q_ref.shape[0]
    H = kv_heads * group

    # Rows of this program: r = token * G + g for the G query heads of kv head h.
    r = rb * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    real = r < q_len * group
    token = jnp.minimum(lax.div(r, group), q_len - 1)  # padding rows: clamp, then discard
    q_row = (b * q_len + token) * H + h * group + lax.rem(r, group)  # row of q.reshape(N, D)
    row_pos = pos_ref[b * q_len + token]
    if has_causal:  # DFlash rows see every key below kv_len
        row_pos = jnp.where(causal_ref[b], row_pos, NONCAUSAL_POS)
    row_pos = jnp.where(real, row_pos, -1)  # padding rows see nothing
    kv_len = jnp.minimum(kv_lens_ref[b], table_width * page_size)  # the reference sees W * S keys at most

    attend_split(q_ref, q_row, k_ref, v_ref, out_refs, sinks_ref, lambda slot: pt_ref[b * table_width + slot],
                 h=h, r=r, group=group, real=real, row_pos=row_pos, kv_len=kv_len, trash_row=N, split=split,
                 page_size=page_size, kv_heads=kv_heads, table_width=table_width, block_kv=block_kv,
                 tokens_per_split=tokens_per_split, splits=splits, sm_scale=sm_scale, window=window)


def attend_split(q_ref, q_row, k_ref, v_ref, out_refs, sinks_ref, page_of, *, h, r, group, real, row_pos, kv_len,
                 trash_row, split, page_size, kv_heads, table_width, block_kv, tokens_per_split, splits, sm_scale,
                 window):
    """A program's rows against the keys of its kv split, for this kernel and
    ragged_paged_attention_gpu.py (which set up their rows differently): rows q_row of
    q_ref [rows of q, D] (padding rows, ``real`` False, write ``trash_row``), ``r`` their
    index r = token * G + g, row_pos each row's last visible position (-1 padding,
    NONCAUSAL_POS every key below kv_len); page_of(slot) the page ids of table slots; kv
    head ``h``. Writes the online softmax over the split's key blocks into out_refs: one
    split, the normalised output (the head's sink joined); more, this split's output and
    its log-sum-exp (the combine joins the sinks)."""
    # Keys this program can see: below kv_len, at or before its rows' largest position,
    # inside its split.
    # The splits share this sequence's kv_len evenly (whole blocks each), not the table's
    # W * S: with one wide table for every context (jspec.ops.page_table_widths) a short
    # context still spreads over every split. tokens_per_split (from W) bounds it.
    end = jnp.minimum(kv_len, jnp.max(row_pos) + 1)
    base = 0  # the first key any row sees, rounded down to a block: a window's start
    if window:
        row_last = jnp.minimum(row_pos, kv_len - 1)
        lowest = jnp.min(jnp.where(real, row_last, kv_len)) - window + 1
        base = lax.div(jnp.maximum(lowest, 0), block_kv) * block_kv
    span = kv_len - base
    per_split = jnp.minimum(lax.div(span + (splits * block_kv - 1), splits * block_kv) * block_kv, tokens_per_split)
    start = base + split * per_split
    end = jnp.minimum(end, start + per_split)
    num_blocks = jnp.maximum(0, lax.div(end - start + (block_kv - 1), block_kv))

    q = q_ref[q_row, :]  # [block_rows, D]; scaled after the dot, in f32, as the reference does
    # Triton's DEFAULT f32 dot is TF32 (~4e-4 relative error, seen on the H200): ask for
    # IEEE f32 when the cache is f32; bf16 operands are unaffected.
    prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    arange = jnp.arange(block_kv, dtype=jnp.int32)

    def body(i, carry, masked=True):
        acc, m, l = carry
        t = start + i * block_kv + arange  # i32[block_kv] token indices
        slot = jnp.minimum(lax.div(t, page_size), table_width - 1)  # t >= W*S is masked anyway
        page = page_of(slot)  # per-token page id
        rows = (page * page_size + lax.rem(t, page_size)) * kv_heads + h
        k = kv_read(k_ref[rows, :], q.dtype)  # [block_kv, D] gather: one contiguous D-row per token
        v = kv_read(v_ref[rows, :], q.dtype)  # (an FP8 cache's converted to q's dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if masked:
            key_ok = t < kv_len  # [block_kv]
            mask = key_ok[None, :] & (t[None, :] <= row_pos[:, None])  # [rows, block_kv]
            if window:
                mask = mask & (t[None, :] > row_last[:, None] - window)
            s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
            v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # junk V may be NaN
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l

    block_rows, D = r.shape[0], q_ref.shape[1]
    acc = jnp.zeros((block_rows, D), jnp.float32)
    m = jnp.full((block_rows,), NEG_INF, jnp.float32)
    l = jnp.zeros((block_rows,), jnp.float32)
    # Blocks every real row sees whole (below kv_len and below the smallest real row's
    # position + 1) skip the masks: padding rows compute junk there, which goes to the trash
    # row. Only blocks at the causal diagonal or the kv_len boundary are masked. On the H200
    # (2026-11-21, batch 1) this took verify-8 from 10.1 to 9.5 us of kernel time.
    lo = jnp.min(jnp.where(real, row_pos, NONCAUSAL_POS)) + 1
    full_end = jnp.minimum(jnp.minimum(kv_len, lo), end)
    n_full = jnp.clip(lax.div(full_end - start, block_kv), 0, num_blocks) if not window else 0  # a window: all masked
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), (acc, m, l))
    acc, m, l = lax.fori_loop(n_full, num_blocks, body, carry)

    o_row = jnp.where(real, q_row, trash_row)  # padding rows -> the trash row
    o_ref = out_refs[0]
    if sinks_ref is not None and len(out_refs) == 1:  # one split: each row's head's sink joins its denominator
        sink = sinks_ref[h * group + lax.rem(r, group)].astype(jnp.float32)
        m_all = jnp.maximum(m, sink)
        scale = jnp.exp(m - m_all)
        acc, l = acc * scale[:, None], l * scale + jnp.exp(sink - m_all)
    o_ref[o_row, :] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    if len(out_refs) == 2:  # a split: its softmax mass too (NEG_INF where it saw no key)
        out_refs[1][o_row] = jnp.where(l == 0.0, NEG_INF, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))


def _combine_kernel(lse_ref, o_ref, *refs, splits: int, rows: int, heads: int = 0):
    """Merge the kv splits of one query row: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max).

    lse_ref f32[splits * rows], o_ref [splits * rows, D] (split s of row n at s * rows + n).
    One launch instead of the 3-4 XLA fusions a jnp combine compiles to (each ~1 us of
    GPU time at batch 1, as much as a third of a decode attention call). ``heads`` > 0: a
    sinks_ref [heads] precedes out_ref, row n's (head n % heads) sink a split of its own
    with no keys: its weight joins the denominator only.
    """
    sinks_ref, out_ref = refs if heads else (None, refs[0])
    n = pl.program_id(0)
    s = jnp.arange(_next_pow2(splits), dtype=jnp.int32)
    real = s < splits
    idx = jnp.minimum(s, splits - 1) * rows + n
    lse = jnp.where(real, lse_ref[idx], NEG_INF)
    o = o_ref[idx, :].astype(jnp.float32)  # [splits_pow2, D]
    # Splits that saw no key have lse = NEG_INF: weight exp(NEG_INF - max) = 0, or, when no
    # split saw a key, weight 1 on all-zero outputs (a zero row, as the reference gives).
    if heads:
        sink = sinks_ref[lax.rem(n, heads)].astype(jnp.float32)
        top = jnp.maximum(jnp.max(lse), sink)
        w = jnp.where(real, jnp.exp(lse - top), 0.0)
        out_ref[...] = (jnp.sum(w[:, None] * o, axis=0) / (jnp.sum(w) + jnp.exp(sink - top))).astype(out_ref.dtype)
        return
    w = jnp.where(real, jnp.exp(lse - jnp.max(lse)), 0.0)
    out_ref[...] = (jnp.sum(w[:, None] * o, axis=0) / jnp.sum(w)).astype(out_ref.dtype)


def combine_splits(o_s, lse, n, dtype, *, kernel: bool, num_warps: int = 2, interpret: bool = False, sinks=None):
    """[splits, rows, D] split outputs + f32[splits, rows] log-sum-exps -> [n, D] (first n rows).
    ``sinks`` [H] (gpt-oss; any float dtype, taken as f32): row r's head r % H sink joins its denominator."""
    splits, rows, D = o_s.shape
    if not kernel:  # the jnp combine (XLA fusions): the reference the kernel is checked against
        lse, o_s = lse[:, :n], o_s[:, :n].astype(jnp.float32)
        if sinks is not None:  # a split of its own, with no keys
            H = sinks.shape[0]
            sink = jnp.tile(sinks.astype(jnp.float32), -(-n // H))[:n]
            lse, o_s = jnp.concatenate([lse, sink[None]]), jnp.concatenate([o_s, jnp.zeros_like(o_s[:1])])
        w = jnp.exp(lse - jnp.max(lse, axis=0)[None])
        o = jnp.sum(w[..., None] * o_s, axis=0) / jnp.sum(w, axis=0)[..., None]
        return o.astype(dtype)
    whole = pl.BlockSpec()
    extra = [] if sinks is None else [sinks]  # read as f32 in the kernel (an XLA convert: a graph node a layer)
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits, rows=rows, heads=0 if sinks is None else sinks.shape[0]),
        grid=(n,),
        in_specs=[whole, whole] + [whole] * len(extra),
        out_specs=pl.BlockSpec((None, D), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, D), dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"paged_attention_combine_s{splits}",
    )(lse.reshape(splits * rows), o_s.reshape(splits * rows, D), *extra)


def default_kv_splits(batch, kv_heads, row_blocks, num_kv_blocks, num_sms: int):
    """Programs along the kv axis: ~2 per SM, or ~4 per SM when the batch alone gives fewer
    programs than SMs; never more than there are kv blocks, nor than MAX_COMBINE_SPLITS.

    On the H200 (2026-11-21): decode at batch 32 x 8 kv heads (256 programs) was fastest
    with 2 splits (1, 4 and 8: 10-20% slower); at batch 1 (8 programs) by profiler GPU
    time, one 64-key block per program (64 splits at context 4096) beat 33 splits
    (decode kernel 7.8 vs 8.6-9.0 us, verify-8 9.5 vs 10.0 us).
    """
    programs = batch * kv_heads * row_blocks
    per_sm = 4 if programs < num_sms else 2
    return max(1, min(num_kv_blocks, MAX_COMBINE_SPLITS, -(-per_sm * num_sms // programs)))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_rows", "block_kv", "kv_splits", "num_warps", "num_stages", "split_dtype",
                     "split_combine", "interpret", "window"),
)
def paged_attention_gpu(
    q,  # [B, Q, H, D] f32 | bf16
    k_pages,  # [P, S, KVH, D] same dtype as q
    v_pages,  # [P, S, KVH, D]
    page_table,  # i32[B, W]; entries past a sequence's pages: any id in [0, P)
    kv_lens,  # i32[B]; keys valid per sequence (0 = empty slot)
    positions,  # i32[B, Q]; position of each query token (causal rows)
    causal=None,  # bool[B] | None; False = DFlash block (sees all kv_lens keys)
    sinks=None,  # [H] | None: gpt-oss's attention sinks (paged_attention.softmax_with_sinks), taken as f32
    *,
    sm_scale: float,
    window: int = 0,  # > 0: gpt-oss's sliding window (the reference's)
    block_rows: int | None = None,  # query rows (tokens x heads of one kv head) per program; pow2
    block_kv: int | None = None,  # keys per inner-loop step; pow2, need not relate to page_size
    kv_splits: int | None = None,  # programs along the kv axis; None: default_kv_splits
    num_warps: int | None = None,  # None: 2 for small grids of <= 32-row tiles split into >= 1 wave, else 4
    num_stages: int | None = None,  # Triton software-pipelining depth of the kv loop; None: 1 for <= 2 blocks, else 2
    split_dtype=None,  # dtype of the per-split outputs (None: the cache dtype)
    split_combine: str = "kernel",  # "kernel" (one Pallas launch; > 64 splits: jnp) | "jnp" (XLA fusions)
    interpret: bool = False,  # True: run the kernel body with Pallas' interpreter (CPU CI)
):  # -> [B, Q, H, D] in q.dtype
    validate_gpu(q, k_pages, block_rows=block_rows, block_kv=block_kv, kv_splits=kv_splits,
                 split_combine=split_combine)
    B, Q, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    W = page_table.shape[1]
    G = H // KVH
    N = B * Q * H
    R = Q * G
    tuning = device_tuning()  # kernels_pallas/tuning.py
    if block_rows is None:  # all rows of a kv head in one program, up to the device's cap
        block_rows = min(max(16, _next_pow2(R)), tuning.attn_max_block_rows)
    if block_kv is None:
        block_kv = tuning.attn_block_kv
    row_blocks = -(-R // block_rows)
    num_kv_blocks = -(-(W * S) // block_kv)
    num_sms = tuning.num_sms  # programs per wave
    if kv_splits is None:
        kv_splits = default_kv_splits(B, KVH, row_blocks, num_kv_blocks, num_sms)
    kv_splits = min(kv_splits, num_kv_blocks)
    blocks_per_split = -(-num_kv_blocks // kv_splits)
    # Short programs (a small grid split finely: one or two kv blocks each) are latency
    # chains: 2 warps and no software pipelining were fastest there on the H200 (batch 1,
    # profiler GPU time: decode kernel 7.8 us vs 8.7 with 4 warps / 2 stages), as long as
    # the splits give at least one program per SM. When the context caps the splits below
    # that (batch 1, context 512: 8-9 splits, 64-72 programs), each program's latency is the
    # call's and 4 warps were faster: decode 4.18 vs 4.38 us, verify-8 5.21 vs 6.58
    # (2026-11-22, scripts/bench_attention.py --b1-sweep --ctx 512; at context 4096, 512
    # programs, 2 warps stay best). Tiles of more than 32 rows keep 4 warps (a 64 x 128 f32
    # accumulator would spill on 2).
    if num_warps is None:
        small_grid = B * KVH * row_blocks < num_sms
        one_wave = B * KVH * row_blocks * kv_splits < num_sms
        num_warps = 2 if small_grid and not one_wave and block_rows <= 32 else 4
    if num_stages is None:
        num_stages = 1 if blocks_per_split <= 2 else 2
    tokens_per_split = blocks_per_split * block_kv

    # Only free reshapes here: at batch 1 every extra XLA op is a kernel launch that costs
    # as much as the attention itself, so queries are gathered and outputs scattered
    # in-kernel instead of transposed around the call.
    has_causal = causal is not None
    inputs = [kv_lens.astype(jnp.int32)] + ([causal] if has_causal else []) + [
        page_table.astype(jnp.int32).reshape(B * W),
        positions.astype(jnp.int32).reshape(B * Q),
        q.reshape(N, D),
        k_pages.reshape(P * S * KVH, D),
        v_pages.reshape(P * S * KVH, D),
    ] + ([] if sinks is None else [sinks])  # in the model's dtype, read as f32 (as combine_splits)
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, page_size=S, kv_heads=KVH, group=G, q_len=Q, table_width=W,
        block_rows=block_rows, block_kv=block_kv, tokens_per_split=tokens_per_split, splits=kv_splits,
        has_causal=has_causal, has_sinks=sinks is not None, window=window,
    )
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    if kv_splits == 1:
        out_shape = jax.ShapeDtypeStruct((N + 1, D), q.dtype)  # + trash row
        out_specs = whole
    else:
        # Each split writes its normalised output and log-sum-exp: in a bf16 cache that is
        # half the bytes of an f32 accumulator plus max and sum, and at batch 1 the split
        # partials of a verify-8 call (64 splits x 256 rows at the defaults) are a main extra
        # cost over decode. Rounding o_s to bf16 before the convex combination costs at most the
        # rounding the bf16 output gets anyway.
        sd = jnp.dtype(split_dtype or q.dtype)
        out_shape = (
            jax.ShapeDtypeStruct((kv_splits, N + 1, D), sd),
            jax.ShapeDtypeStruct((kv_splits, N + 1), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, N + 1, D), lambda b, h, r, s: (s, 0, 0)),
            pl.BlockSpec((None, N + 1), lambda b, h, r, s: (s, 0)),
        )
    out = pl.pallas_call(
        kernel,
        grid=(B, KVH, row_blocks, kv_splits),
        in_specs=[whole] * len(inputs),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_gpu_r{block_rows}_k{block_kv}_s{kv_splits}" + ("_sinks" if sinks is not None else "")
        + (f"_w{window}" if window else ""),
    )(*inputs)

    if kv_splits == 1:
        return out[:N].reshape(B, Q, H, D)
    # More splits than the combine kernel holds (only when asked for explicitly): jnp.
    use_kernel = split_combine == "kernel" and kv_splits <= MAX_COMBINE_SPLITS
    o = combine_splits(out[0], out[1], N, q.dtype, kernel=use_kernel, interpret=interpret, sinks=sinks)
    return o.reshape(B, Q, H, D)
