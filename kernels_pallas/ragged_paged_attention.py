"""Paged attention over one flat token batch (vLLM V1's "ragged" layout): contract, jnp
reference and the kernels' public entries (kernel_gpu, kernel_tpu).

A step is one flat batch of T tokens (T a bucket). Each sequence contributes one
contiguous segment of them: a prefill chunk, one decode token, K + 1 tokens to verify, or a
DFlash block. Shapes never depend on the mix: N (sequences) and T are buckets, the number
of sequences present is a traced count.

  q:          [T, H, D]        the step's queries; tokens past the last segment are padding
  k_pages,
  v_pages:    [P, S, KVH, D]   one layer's paged cache (jspec.kv_cache.KVCache), already
                               holding this step's K/V
  cu_q_lens:  i32[N + 1]       segment i is q[cu_q_lens[i] : cu_q_lens[i + 1]];
                               cu_q_lens[0] == 0, non-decreasing up to num_seqs,
                               cu_q_lens[num_seqs] <= T; entries past num_seqs are ignored
  kv_lens:    i32[N]           keys of sequence i after this step's writes (<= W * S; a
                               larger value reads as W * S)
  page_table: i32[N, W]        page ids of sequence i, in order; entries past its pages may
                               hold anything (ids are clipped into [0, P), never trusted)
  num_seqs:   i32[1]           sequences present: rows i >= num_seqs of the metadata are
                               ignored (traced: changing it compiles nothing)
  causal:     bool[N] | None   False: every query of the segment sees all kv_lens[i] keys
                               (DFlash's non-causal block); None: all causal
  -> out:     [T, H, D]        in q.dtype

Masking. Query j of segment i (q_len = cu_q_lens[i + 1] - cu_q_lens[i], kv_len =
kv_lens[i]) sits at position kv_len - q_len + j and sees keys 0 .. that position (causal)
or keys 0 .. kv_len - 1 (non-causal). A query that sees no key (padding tokens at
t >= cu_q_lens[num_seqs], a causal query with a negative position) outputs 0: every row of
the output is written, and no padding row can make another row NaN.

GQA: H is a multiple of KVH; query head h reads kv head h // (H / KVH).

Pages past a sequence's keys may hold anything (tests poison them with NaN): the
reference, like the kernels, zeroes masked values rather than relying on
exp(-inf) * v == 0 (0 * NaN is NaN).

Kernels: ragged_paged_attention_gpu.py (Pallas, Triton backend), ragged_paged_attention_tpu.py
(Pallas, Mosaic TPU). They take the same arguments in the KV cache's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention import (
    FP8_CACHE_TPU,
    is_fp8,
    kv_compute_dtype,
    kv_read,
    softmax_with_sinks,
    validate_cache,
)

NEG_INF = -1e30  # finite "minus infinity": exp(NEG_INF - NEG_INF) stays defined


def validate(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal):
    """Trace-time shape and dtype checks with messages that name the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {q.shape}")
    _, H, D = q.shape
    validate_cache(H, D, k_pages, v_pages)
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [max_num_seqs, pages_per_seq], got {page_table.shape}")
    N = page_table.shape[0]
    for name, a, shape in (("cu_q_lens", cu_q_lens, (N + 1,)), ("kv_lens", kv_lens, (N,)),
                           ("num_seqs", num_seqs, (1,))):
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (N = page_table.shape[0] = {N}), got {a.shape}")
    for name, a in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), ("page_table", page_table),
                    ("num_seqs", num_seqs)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (i32), got {a.dtype}")
    if causal is not None and (causal.shape != (N,) or causal.dtype != jnp.bool_):
        raise ValueError(f"causal must be bool[{N}] or None, got {causal.dtype}{list(causal.shape)}")


def token_layout(cu_q_lens, kv_lens, num_seqs, causal, num_tokens: int, max_kv: int):
    """Where each token of the flat batch belongs, by the contract's rules.

    Returns (seq i32[T]: the token's sequence, clipped into [0, N) for padding tokens;
    last i32[T]: the last key the token sees, -1 for padding tokens and for queries that
    see no key). Key l is visible to token t iff l <= last[t] (last < that sequence's
    kv_len). Shared by the reference and the TPU kernel's wrapper (its row metadata).
    """
    N = kv_lens.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    ns = jnp.clip(num_seqs.astype(jnp.int32)[0], 0, N)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    i = jnp.arange(1, N + 1, dtype=jnp.int32)
    # Token t is in segment s iff cu[s] <= t < cu[s + 1]: s counts the boundaries at or
    # below t (empty segments before t count too, which is right: t is past them).
    seq = jnp.sum((cu[1:][None, :] <= t[:, None]) & (i[None, :] <= ns), axis=1, dtype=jnp.int32)
    real = (t >= cu[0]) & (t < cu[ns])
    seq = jnp.minimum(seq, N - 1)
    kv_len = jnp.clip(kv_lens.astype(jnp.int32), 0, max_kv)[seq]
    q_len = cu[seq + 1] - cu[seq]
    pos = kv_len - q_len + (t - cu[seq])
    last = jnp.minimum(pos, kv_len - 1)
    if causal is not None:
        last = jnp.where(causal[seq], last, kv_len - 1)
    return seq, jnp.where(real, jnp.maximum(last, -1), -1)


def ref_ragged_paged_attention(
    q,  # [T, H, D]
    k_pages,  # [P, S, KVH, D]
    v_pages,  # [P, S, KVH, D]
    cu_q_lens,  # i32[N + 1]
    kv_lens,  # i32[N]
    page_table,  # i32[N, W]
    num_seqs,  # i32[1]
    causal=None,  # bool[N] | None (None: all causal)
    sinks=None,  # f32[H] | None: gpt-oss's attention sinks (paged_attention.softmax_with_sinks)
    *,
    sm_scale: float,
    window: int = 0,  # > 0: a token sees the window keys up to its last (gpt-oss's sliding layers)
):  # -> [T, H, D] in q.dtype
    """Plain masked softmax, each token against its own sequence's keys.

    It gathers every token's keys ([T, W * S, KVH, D]): for tests and tiny models, not for
    long contexts (the kernels stream pages instead).
    """
    validate(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal)
    T, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    G = H // KVH
    W = page_table.shape[1]
    seq, last = token_layout(cu_q_lens, kv_lens, num_seqs, causal, T, W * S)
    pages = jnp.clip(page_table.astype(jnp.int32), 0, P - 1)[seq]  # [T, W]
    k = kv_read(k_pages[pages].reshape(T, W * S, KVH, D), q.dtype)
    v = kv_read(v_pages[pages].reshape(T, W * S, KVH, D), q.dtype)
    key = jnp.arange(W * S, dtype=jnp.int32)[None, :]
    visible = key <= last[:, None]  # [T, L]
    if window:
        visible = visible & (key > last[:, None] - window)
    v = jnp.where(visible[:, :, None, None], v, jnp.zeros((), v.dtype))  # unseen V may be NaN
    qg = q.reshape(T, KVH, G, D)
    s = jnp.einsum("thgd,tlhd->thgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, KVH, G, 1)
    p = softmax_with_sinks(s, visible[:, None, None, :], sink)  # tokens that see no key -> 0
    o = jnp.einsum("thgl,tlhd->thgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(T, H, D).astype(q.dtype)


def unsupported_shape_gpu(head_dim: int) -> str | None:
    """Why the GPU kernel cannot take this head_dim (its dot tiles are powers of 2 >= 16), or None."""
    from kernels_pallas import ragged_paged_attention_gpu as gpu  # local: light imports

    return gpu.unsupported_shape(head_dim)


def unsupported_shape_tpu(head_dim: int) -> str | None:
    """Why the TPU kernel cannot take this head_dim (a multiple of 128 lanes), or None."""
    from kernels_pallas import ragged_paged_attention_tpu as tpu  # local: light imports

    return tpu.unsupported_shape(head_dim)


def _check(unsupported, q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal):
    validate(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal)
    reason = unsupported(q.shape[-1])
    if reason is not None:
        raise ValueError(f"ragged_paged_attention: {reason}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_q", "block_kv", "window"))
def kernel_gpu(
    q,  # [T, H, D]
    k_pages,  # [P, S, KVH, D]
    v_pages,  # [P, S, KVH, D]
    cu_q_lens,  # i32[N + 1]
    kv_lens,  # i32[N]
    page_table,  # i32[N, W]
    num_seqs,  # i32[1]
    causal=None,  # bool[N] | None
    sinks=None,  # f32[H] | None: gpt-oss (the reference's; the TPU kernel does not take them yet)
    *,
    sm_scale: float,
    window: int = 0,
    interpret: bool = False,  # the kernel body in Pallas' interpreter (any platform)
    block_q: int | None = None,  # query tokens per program (None: the kernel's default)
    block_kv: int | None = None,  # keys per inner step
):  # -> [T, H, D] in q.dtype
    """Public GPU entry (contract in the module docstring; the reference:
    ref_ragged_paged_attention): the Triton-backend kernel (ragged_paged_attention_gpu.py)
    in the KV cache dtype, on the head_dims ``unsupported_shape_gpu`` passes. Further
    tuning: the kernel module's own entry."""
    from kernels_pallas import ragged_paged_attention_gpu as gpu  # local: light imports

    meta = (cu_q_lens, kv_lens, page_table, num_seqs, causal)
    _check(unsupported_shape_gpu, q, k_pages, v_pages, *meta)
    out = gpu.ragged_paged_attention_gpu(q.astype(kv_compute_dtype(q.dtype, k_pages.dtype)), k_pages, v_pages, *meta,
                                         sinks, sm_scale=sm_scale, window=window, block_q=block_q, block_kv=block_kv,
                                         interpret=interpret)
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_q", "block_kv"))
def kernel_tpu(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, causal=None, *, sm_scale: float,
               interpret: bool = False, block_q: int | None = None, block_kv: int | None = None):
    """Public TPU entry: as ``kernel_gpu``, through the Mosaic TPU kernel
    (ragged_paged_attention_tpu.py; ``interpret``: under pltpu.InterpretParams, on a CPU);
    block_kv a multiple of page_size."""
    from kernels_pallas import ragged_paged_attention_tpu as tpu  # local: light imports

    meta = (cu_q_lens, kv_lens, page_table, num_seqs, causal)
    _check(unsupported_shape_tpu, q, k_pages, v_pages, *meta)
    if is_fp8(k_pages.dtype):
        raise ValueError(f"ragged_paged_attention: {FP8_CACHE_TPU}")
    S = k_pages.shape[1]
    if block_kv is not None and block_kv % S:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={S} for the TPU kernel")
    ppb = {} if block_kv is None else dict(pages_per_block=block_kv // S)
    out = tpu.ragged_paged_attention_tpu(q.astype(k_pages.dtype), k_pages, v_pages, *meta, sm_scale=sm_scale,
                                         block_q=block_q, interpret=interpret, **ppb)
    return out.astype(q.dtype)
