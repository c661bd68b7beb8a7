"""Paged attention over jspec's KV layout: the jnp reference and the kernels' public entries.

Layout (per layer): ``k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]``.
A flat slot index ``page * page_size + offset`` addresses one token's K/V, so writing new
tokens is a single scatter over ``[num_pages * page_size, kv_heads, head_dim]``.

Queries come per sequence, padded: ``q: [B, Q, num_heads, head_dim]``. Each sequence b
carries ``q_lens[b]`` real query tokens (0 = empty batch slot) at ``positions[b, :]``, and
``kv_lens[b]`` valid keys (the tokens of this step already written). This one layout serves
every query mode of a speculative engine:
  - decode: Q = 1;  verification: Q = K + 1, causal;  prefill chunk: Q = chunk, causal;
  - DFlash block: ``causal[b] = False``: every query sees all ``kv_lens[b]`` keys, i.e.
    the context plus the whole block (the block's K/V were just written at its positions).
Causal masking is by position: key j is visible to a query at position p iff j <= p.
gpt-oss's two additions (the references, the CPU path and the GPU kernel take them; where a
kernel does not yet, jspec.ops.attention runs the reference): ``window`` > 0, a query sees only the ``window``
keys up to its last visible one (last - window < j <= last); ``sinks`` f32[H], a logit per
head that joins each query's softmax denominator, exp(sink - m) / (sum_j exp(s_j - m) +
exp(sink - m)) left unattended (``softmax_with_sinks``).

Pages past a sequence's length may hold anything (tests poison them with NaN), so the
reference zeroes masked values rather than relying on exp(-inf) * v == 0.

An FP8 cache (float8_e4m3fn pages: vLLM's kv_cache_dtype="fp8", its scales at 1.0) holds
each value rounded to e4m3 and saturated at +-448 (``kv_store``, every writer); the
references and the GPU kernels convert what they read to q's dtype (``kv_compute_dtype``).
The TPU kernels take 16/32-bit pages only (their ``_check``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def is_fp8(dtype) -> bool:
    """A one-byte float (float8_e4m3fn): an FP8 KV cache's dtype, or an FP8 weight's
    (kernels_pallas/fused_linear.py)."""
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def kv_store(x, dtype):
    """x as the cache holds it: cast to ``dtype``; into an FP8 cache saturated at its largest
    finite value first (448 for e4m3), as vLLM's conversion does (float8_e4m3fn has no
    infinity: a plain cast turns an overflow into NaN)."""
    if is_fp8(dtype):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def kv_compute_dtype(q_dtype, cache_dtype):
    """The dtype attention computes in over a cache of ``cache_dtype``: the cache's, or for
    an FP8 cache the queries' (its values are exact in bf16 / f16 / f32)."""
    return jnp.dtype(q_dtype) if is_fp8(cache_dtype) else jnp.dtype(cache_dtype)


def kv_read(x, q_dtype):
    """Cache values read for attention: an FP8 cache's converted to q's dtype, others as they are."""
    return x.astype(q_dtype) if is_fp8(x.dtype) else x


def softmax_with_sinks(s, mask, sink=None):
    """Masked softmax over the last axis of the f32 scores ``s`` (``mask`` False: not seen);
    ``sink``: f32 broadcastable to s[..., :1], the sinks' logits joining each denominator
    (None: the plain softmax). A row that sees nothing gives zeros."""
    m = jnp.max(jnp.where(mask, s, NEG_INF), axis=-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    return p / jnp.where(denom == 0, 1.0, denom)


def validate_cache(num_heads: int, head_dim: int, k_pages, v_pages):
    """Trace-time checks of one layer's paged cache against the queries' heads."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [num_pages, page_size, kv_heads, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, k_pages has {k_pages.shape[-1]}")
    if num_heads % k_pages.shape[2]:
        raise ValueError(f"num_heads={num_heads} (q) is not a multiple of kv_heads={k_pages.shape[2]} (k_pages)")


def validate(q, k_pages, v_pages, page_table, kv_lens, positions, causal):
    """Trace-time shape checks with messages that name the argument."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, num_heads, head_dim], got shape {q.shape}")
    B, Q, H, D = q.shape
    validate_cache(H, D, k_pages, v_pages)
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be [B={B}, pages_per_seq], got {page_table.shape}")
    if kv_lens.shape != (B,):
        raise ValueError(f"kv_lens must be [B={B}], got {kv_lens.shape}")
    if positions.shape != (B, Q):
        raise ValueError(f"positions must be [B={B}, Q={Q}], got {positions.shape}")
    if causal is not None and causal.shape != (B,):
        raise ValueError(f"causal must be [B={B}] bool, got {causal.shape}")


def ref_paged_attention(
    q,  # [B, Q, H, D]
    k_pages,  # [P, S, KVH, D]
    v_pages,  # [P, S, KVH, D]
    page_table,  # i32[B, pages_per_seq]
    kv_lens,  # i32[B]
    positions,  # i32[B, Q]
    causal=None,  # bool[B] | None (None: all causal)
    sinks=None,  # f32[H] | None
    *,
    sm_scale: float,
    window: int = 0,
):  # -> [B, Q, H, D] in q.dtype
    validate(q, k_pages, v_pages, page_table, kv_lens, positions, causal)
    B, Q, H, D = q.shape
    P, S, KVH, _ = k_pages.shape
    G = H // KVH
    pages = jnp.clip(page_table, 0, P - 1)
    k = kv_read(k_pages[pages].reshape(B, -1, KVH, D), q.dtype)  # [B, L, KVH, D], L = pages_per_seq * S
    v = kv_read(v_pages[pages].reshape(B, -1, KVH, D), q.dtype)
    L = k.shape[1]
    kj = jnp.arange(L, dtype=jnp.int32)
    valid_k = kj[None, :] < kv_lens[:, None]  # [B, L]
    v = jnp.where(valid_k[:, :, None, None], v, jnp.zeros((), v.dtype))
    qg = q.reshape(B, Q, KVH, G, D)
    s = jnp.einsum("bqhgd,blhd->bhgql", qg, k, preferred_element_type=jnp.float32) * sm_scale
    visible = valid_k[:, None, :]  # [B, 1, L]
    causal_mask = kj[None, None, :] <= positions[:, :, None]  # [B, Q, L]
    if causal is not None:
        causal_mask = causal_mask | ~causal[:, None, None]
    mask = visible & causal_mask  # [B, Q, L]
    if window:  # the window keys up to the last one each query sees
        last = jnp.minimum(positions, kv_lens[:, None] - 1)
        if causal is not None:
            last = jnp.where(causal[:, None], last, kv_lens[:, None] - 1)
        mask = mask & (kj[None, None, :] > last[:, :, None] - window)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, KVH, G, 1, 1)
    p = softmax_with_sinks(s, mask[:, None, None], sink)  # rows with no visible key (padding) -> 0
    o = jnp.einsum("bhgql,blhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, Q, H, D).astype(q.dtype)


def write_kv(
    k_pages,  # [P, S, KVH, D]
    v_pages,  # [P, S, KVH, D]
    k_new,  # [B, Q, KVH, D]
    v_new,  # [B, Q, KVH, D]
    slot_mapping,  # i32[B, Q]: page * S + offset; padding tokens carry P * S (dropped)
):  # -> (k_pages, v_pages)
    P, S, KVH, D = k_pages.shape
    idx = slot_mapping.reshape(-1)
    k_new = kv_store(k_new.reshape(-1, KVH, D), k_pages.dtype)
    v_new = kv_store(v_new.reshape(-1, KVH, D), v_pages.dtype)
    if idx.shape[0] == 1:
        # XLA rewrites a one-row scatter as select(in_bounds, dynamic_update_slice(cache),
        # cache), which keeps the old and the new cache alive at once: a full copy of the
        # buffer (and an OOM when the page pool fills the device). A second row, always
        # dropped, keeps it a scatter, done in place.
        idx = jnp.concatenate([idx, jnp.full((1,), P * S, idx.dtype)])
        k_new = jnp.concatenate([k_new, k_new])
        v_new = jnp.concatenate([v_new, v_new])
    k = k_pages.reshape(P * S, KVH, D).at[idx].set(k_new, mode="drop")
    v = v_pages.reshape(P * S, KVH, D).at[idx].set(v_new, mode="drop")
    return k.reshape(P, S, KVH, D), v.reshape(P, S, KVH, D)


def unsupported_shape_gpu(head_dim: int) -> str | None:
    """Why the GPU kernel cannot take this head_dim (its dot tiles are powers of 2 >= 16), or None."""
    from kernels_pallas import paged_attention_gpu as gpu  # local: light imports

    return gpu.unsupported_shape(head_dim)


FP8_CACHE_TPU = "an FP8 KV cache: the TPU kernels read 16/32-bit pages"


def unsupported_shape_tpu(head_dim: int) -> str | None:
    """Why the TPU kernel cannot take this head_dim (a multiple of 128 lanes), or None."""
    from kernels_pallas import paged_attention_tpu as tpu  # local: light imports

    return tpu.unsupported_shape(head_dim)


def _check(unsupported, q, k_pages, v_pages, page_table, kv_lens, positions, causal):
    validate(q, k_pages, v_pages, page_table, kv_lens, positions, causal)
    reason = unsupported(q.shape[-1])
    if reason is not None:
        raise ValueError(f"paged_attention: {reason}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "window"))
def kernel_gpu(q, k_pages, v_pages, page_table, kv_lens, positions, causal=None, sinks=None, *, sm_scale,
               interpret=False, window: int = 0):
    """Public GPU entry: ref_paged_attention's arguments and result, through the Triton-backend
    kernel (paged_attention_gpu.py, its tuning at the defaults; ``interpret``: its body in
    Pallas' interpreter, any platform) on the head_dims ``unsupported_shape_gpu`` passes. The
    kernel runs in the KV cache dtype; the output is in q.dtype like the reference's. It takes
    gpt-oss's ``sinks`` and ``window`` (the TPU kernel does not yet)."""
    from kernels_pallas import paged_attention_gpu as gpu  # local: light imports

    _check(unsupported_shape_gpu, q, k_pages, v_pages, page_table, kv_lens, positions, causal)
    out = gpu.paged_attention_gpu(q.astype(kv_compute_dtype(q.dtype, k_pages.dtype)), k_pages, v_pages, page_table,
                                  kv_lens, positions, causal, sinks, sm_scale=sm_scale, interpret=interpret,
                                  window=window)
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def kernel_tpu(q, k_pages, v_pages, page_table, kv_lens, positions, causal=None, *, sm_scale, interpret=False):
    """Public TPU entry: as ``kernel_gpu``, through the Mosaic TPU kernel
    (paged_attention_tpu.py; ``interpret``: under pltpu.InterpretParams, on a CPU)."""
    from kernels_pallas import paged_attention_tpu as tpu  # local: light imports

    _check(unsupported_shape_tpu, q, k_pages, v_pages, page_table, kv_lens, positions, causal)
    if is_fp8(k_pages.dtype):
        raise ValueError(f"paged_attention: {FP8_CACHE_TPU}")
    out = tpu.paged_attention_tpu(q.astype(k_pages.dtype), k_pages, v_pages, page_table, kv_lens, positions, causal,
                                  sm_scale=sm_scale, interpret=interpret)
    return out.astype(q.dtype)
