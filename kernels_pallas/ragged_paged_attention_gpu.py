"""Ragged paged attention over a flat token batch for NVIDIA GPUs: a Pallas kernel on the
Triton backend.

Contract: ragged_paged_attention.py (q [T, H, D], segments by cu_q_lens, a zero output for
tokens that see no key). Triton rather than Mosaic GPU for the reasons of
paged_attention_gpu.py (a per-token pointer gather turns the page table into ordinary loads
Triton pipelines; the Triton backend is deprecated in jax 0.11 but works there).

Design: vLLM's unified Triton attention grid, with the flash-decoding splits and GQA
packing of paged_attention_gpu.py.
- Grid (q_block, kv_head, kv_split). Sequence i owns the q blocks
  [cu[i] // BQ + i, cu[i + 1] // BQ + i + 1) (BQ = block_q tokens per program): at least
  ceil(q_len / BQ) of them, found with no table, and T // BQ + N + 1 blocks cover any mix.
  The padding tail [cu[num_seqs], T) is one more "sequence" with no keys, so its programs
  write the zero rows: every output row is written, with no memset launch. Each program
  finds its sequence by comparing its block index with those N + 1 starts (one vector load
  of cu_q_lens and a sum, no search loop), and a program past its sequence's tokens has no
  real rows (it computes nothing and writes only the trash row).
  Why this grid rather than [B, Q] rows: the segments' lengths are traced, so only the
  flat axis has a static size; a block never spans two sequences, so a program reads one
  sequence's pages, as paged_attention_gpu.py does.
- Rows of a program are its BQ tokens times the G = H / KVH query heads of its kv head
  (row = token * G + g), so a K/V page is read once per (q block, kv head): verifying K + 1
  tokens in one block costs the bytes of decoding one. Tiles are powers of 2 >= 16 rows;
  with decode tokens (one per sequence) most rows of a block are padding, which is compute
  a memory-bound call has to spare.
- Online softmax over ``block_kv`` keys per step within the program's kv split
  (paged_attention_gpu.attend_split, the same code as that kernel's once the rows are set
  up); splits share the sequence's kv_len evenly and a second small kernel merges them
  (paged_attention_gpu.combine_splits). A block skips keys past its rows' last position
  (prefill chunks), and only blocks at kv_len or at a causal diagonal pay for the masks.
- NaN safety as paged_attention_gpu.py: masked scores via ``where``, V rows at or past
  kv_len zeroed before the PV dot; page ids clipped into [0, P) since junk table entries
  are still gathered (for keys that are then masked).

In the engine's steps on the H200 (jax 0.11.2, 2026-12-01, scripts/step_profile.py --q 16 / 4 at
context 512, batch 1; raw docs/bench/2026-12-01_fp8_verify_step_profile_h200.log): Qwen3-8B's 16-token
verification 8.2 us a layer + 1.9 for the combine, Llama-3.1-8B's 4 tokens 7.3 + 1.8. Its own
benchmark (scripts/bench_ragged_attention.py) has not run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.paged_attention import kv_compute_dtype
from kernels_pallas.paged_attention_gpu import (
    MAX_COMBINE_SPLITS,
    NONCAUSAL_POS,
    _next_pow2,
    attend_split,
    combine_splits,
    default_kv_splits,
)
from kernels_pallas.paged_attention_gpu import unsupported_shape as unsupported_shape  # same tiles
from kernels_pallas.tuning import device_tuning


def validate_gpu(q, k_pages, *, block_q, block_kv, kv_splits):
    """Trace-time checks for what the Triton lowering needs (power-of-2 tiles)."""
    D = q.shape[-1]
    if unsupported_shape(D):
        raise ValueError(f"head_dim must be a power of 2 >= 16 for the Triton kernel, got {D}")
    if q.dtype != kv_compute_dtype(q.dtype, k_pages.dtype):  # an FP8 cache: any q dtype (read into it)
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_pages.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype must be f32, bf16 or f16, got {q.dtype}")
    if block_q is not None and block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    if block_kv is not None and (block_kv < 16 or block_kv & (block_kv - 1)):
        raise ValueError(f"block_kv must be a power of 2 >= 16 (Triton dot tiles), got {block_kv}")
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")


def default_block_q(num_tokens: int, max_seqs: int, group: int, max_rows: int) -> int:
    """Tokens per program: the mean segment length T / N (what the bucket says of the mix),
    in a power-of-2 tile of 16 to ``max_rows`` rows, filled (a decode step still gets
    16 // G tokens per block: fewer, emptier programs at no cost)."""
    mean = -(-num_tokens // max_seqs)
    rows = min(max(16, _next_pow2(mean * group)), max(max_rows, _next_pow2(group)))
    return max(1, rows // group)


def _kernel(
    cu_ref,  # i32[N + 1]
    kv_lens_ref,  # i32[N]
    num_seqs_ref,  # i32[1]
    *refs,  # [causal_ref bool[N]], pt_ref i32[N * W], q_ref [T * H, D], k_ref, v_ref, outputs
    sm_scale: float,
    page_size: int,
    kv_heads: int,
    group: int,  # G = H / KVH
    num_tokens: int,  # T
    table_width: int,  # W
    block_q: int,
    block_rows: int,
    block_kv: int,
    tokens_per_split: int,
    splits: int,
    has_causal: bool,
    has_sinks: bool = False,  # gpt-oss: sinks_ref [H] after v_ref (as paged_attention_gpu.py)
    window: int = 0,  # gpt-oss's sliding layers
):
    # k_ref/v_ref: [P * S * KVH, D] (row = (page * S + slot) * KVH + head), [sinks_ref]. Outputs: o_ref
    # [T * H + 1, D] (one split) or per split o_ref [T * H + 1, D] and lse_ref f32[T * H + 1];
    # row T * H is the trash row that padding rows write to (as in paged_attention_gpu.py).
    causal_ref, refs = (refs[0], refs[1:]) if has_causal else (None, refs)
    pt_ref, q_ref, k_ref, v_ref, *out_refs = refs
    sinks_ref = out_refs.pop(0) if has_sinks else None
    qb, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    N = kv_lens_ref.shape[0]
    T = num_tokens
    H = kv_heads * group
    max_kv = table_width * page_size  # the reference sees W * S keys at most

    # This block's sequence: the last i <= num_seqs whose first block cu[i] // BQ + i is at
    # or before qb. i == num_seqs is the padding tail [cu[num_seqs], T), which has no keys.
    ns = jnp.clip(num_seqs_ref[0], 0, N)
    i = jnp.arange(_next_pow2(N + 1), dtype=jnp.int32)
    starts = lax.div(cu_ref[jnp.minimum(i, N)], block_q) + i
    seq = jnp.maximum(jnp.sum(((starts <= qb) & (i <= ns)).astype(jnp.int32)) - 1, 0)
    present = seq < ns
    seq_c = jnp.minimum(seq, N - 1)
    q_start = cu_ref[seq]
    q_end = jnp.where(present, cu_ref[jnp.minimum(seq + 1, N)], T)
    kv_len = jnp.where(present, jnp.clip(kv_lens_ref[seq_c], 0, max_kv), 0)

    # Rows: r = token * G + g over the block's tokens q_start + local * BQ + [0, BQ).
    local = qb - (lax.div(q_start, block_q) + seq)
    r = jnp.arange(block_rows, dtype=jnp.int32)
    tok = q_start + local * block_q + lax.div(r, group)
    real = (r < block_q * group) & (tok < q_end) & (tok < T)
    q_row = jnp.clip(tok, 0, T - 1) * H + h * group + lax.rem(r, group)  # row of q.reshape(T * H, D)
    row_pos = kv_len - (q_end - q_start) + (tok - q_start)
    if has_causal:  # DFlash rows see every key below kv_len
        row_pos = jnp.where(causal_ref[seq_c], row_pos, NONCAUSAL_POS)
    row_pos = jnp.where(real, row_pos, -1)  # padding rows see nothing

    num_pages = k_ref.shape[0] // (page_size * kv_heads)
    attend_split(q_ref, q_row, k_ref, v_ref, out_refs, sinks_ref,
                 lambda slot: jnp.clip(pt_ref[seq_c * table_width + slot], 0, num_pages - 1),  # junk entries: any value
                 h=h, r=r, group=group, real=real, row_pos=row_pos, kv_len=kv_len, trash_row=T * H, split=split,
                 page_size=page_size, kv_heads=kv_heads, table_width=table_width, block_kv=block_kv,
                 tokens_per_split=tokens_per_split, splits=splits, sm_scale=sm_scale, window=window)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_q", "block_kv", "kv_splits", "num_warps", "num_stages", "interpret", "window"),
)
def ragged_paged_attention_gpu(
    q,  # [T, H, D] f32 | bf16 | f16
    k_pages,  # [P, S, KVH, D] same dtype as q
    v_pages,  # [P, S, KVH, D]
    cu_q_lens,  # i32[N + 1]
    kv_lens,  # i32[N]
    page_table,  # i32[N, W]
    num_seqs,  # i32[1]
    causal=None,  # bool[N] | None
    sinks=None,  # [H] | None: gpt-oss's attention sinks (the reference's), taken as f32
    *,
    sm_scale: float,
    window: int = 0,  # > 0: gpt-oss's sliding window (the reference's)
    block_q: int | None = None,  # query tokens per program (None: default_block_q)
    block_kv: int | None = None,  # keys per inner-loop step; pow2 >= 16
    kv_splits: int | None = None,  # programs along the kv axis (None: by the grid's size)
    num_warps: int | None = None,  # None: 2 for small grids of <= 32-row tiles, else 4
    num_stages: int | None = None,  # None: 1 for <= 2 kv blocks per split, else 2
    interpret: bool = False,  # True: Pallas' interpreter (CPU CI)
):  # -> [T, H, D] in q.dtype
    validate_gpu(q, k_pages, block_q=block_q, block_kv=block_kv, kv_splits=kv_splits)
    T, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    N, W = page_table.shape
    G = H // KVH
    tuning = device_tuning()  # kernels_pallas/tuning.py
    if block_q is None:
        block_q = default_block_q(T, N, G, tuning.attn_max_block_rows)
    block_rows = max(16, _next_pow2(block_q * G))
    if block_kv is None:
        block_kv = tuning.attn_block_kv
    q_blocks = T // block_q + N + 1  # covers any mix (module docstring)
    num_kv_blocks = -(-(W * S) // block_kv)
    # Splits from the programs that do work: about one per segment or per BQ tokens,
    # whichever is more (the other q blocks exit at once).
    busy_blocks = max(N, -(-T // block_q))
    if kv_splits is None:
        kv_splits = default_kv_splits(busy_blocks, KVH, 1, num_kv_blocks, tuning.num_sms)
    kv_splits = min(kv_splits, num_kv_blocks)
    blocks_per_split = -(-num_kv_blocks // kv_splits)
    if num_warps is None:  # as paged_attention_gpu.py (measured there on the H200)
        small_grid = busy_blocks * KVH < tuning.num_sms
        one_wave = busy_blocks * KVH * kv_splits < tuning.num_sms
        num_warps = 2 if small_grid and not one_wave and block_rows <= 32 else 4
    if num_stages is None:
        num_stages = 1 if blocks_per_split <= 2 else 2

    has_causal = causal is not None
    inputs = [cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), num_seqs.astype(jnp.int32)]
    inputs += ([causal] if has_causal else []) + [
        page_table.astype(jnp.int32).reshape(N * W),
        q.reshape(T * H, D),  # free reshapes only: no transposes around the call
        k_pages.reshape(P * S * KVH, D),
        v_pages.reshape(P * S * KVH, D),
    ] + ([] if sinks is None else [sinks])  # read as f32 in the kernel
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, page_size=S, kv_heads=KVH, group=G, num_tokens=T, table_width=W,
        block_q=block_q, block_rows=block_rows, block_kv=block_kv, tokens_per_split=blocks_per_split * block_kv,
        splits=kv_splits, has_causal=has_causal, has_sinks=sinks is not None, window=window,
    )
    rows = T * H
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    if kv_splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows + 1, D), q.dtype)  # + trash row
        out_specs = whole
    else:  # each split's normalised output (cache dtype) and log-sum-exp
        out_shape = (jax.ShapeDtypeStruct((kv_splits, rows + 1, D), q.dtype),
                     jax.ShapeDtypeStruct((kv_splits, rows + 1), jnp.float32))
        out_specs = (pl.BlockSpec((None, rows + 1, D), lambda b, h, s: (s, 0, 0)),
                     pl.BlockSpec((None, rows + 1), lambda b, h, s: (s, 0)))
    out = pl.pallas_call(
        kernel,
        grid=(q_blocks, KVH, kv_splits),
        in_specs=[whole] * len(inputs),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_q{block_q}_k{block_kv}_s{kv_splits}"
        + ("_sinks" if sinks is not None else "") + (f"_w{window}" if window else ""),
    )(*inputs)
    if kv_splits == 1:
        return out[:rows].reshape(T, H, D)
    o = combine_splits(out[0], out[1], rows, q.dtype, kernel=kv_splits <= MAX_COMBINE_SPLITS, interpret=interpret,
                       sinks=sinks)
    return o.reshape(T, H, D)
