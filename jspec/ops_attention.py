"""Attention through the paged KV cache: which kernel serves which step's metadata (the
attention half of the ops facade, jspec/ops.py, which re-exports ``attention``)."""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jspec.kernel_backend import GPU, TPU, XLA, Backend, shape_fallback
from jspec.kernel_plan import KernelPlan
from jspec.kv_cache import AttentionMetadata, MixedMetadata, RaggedMetadata
from jspec.parallel.mesh import TP_AXIS
from kernels_pallas import paged_attention as _pa
from kernels_pallas import ragged_paged_attention as _rpa
from kernels_pallas.ragged_attention_xla import ragged_attention_xla


def attention(plan: KernelPlan, q, k_pages, v_pages, meta: AttentionMetadata | MixedMetadata, *, sm_scale: float,
              sinks=None, window: int = 0):
    """Paged attention of q [B, Q, H, D] over the cache [P, S, KVH, D] -> [B, Q, H, D]
    (kernels_pallas/paged_attention.py for the semantics). With ``MixedMetadata`` q is
    [1, N, H, D], the segments' rows flattened in order: one call per segment, on its
    own [B_i, Q_i] layout. gpt-oss's ``sinks`` (f32[H]) and sliding ``window`` (static):
    the references, the CPU path and the GPU kernels take them; a step the TPU kernels
    would serve runs XLA's reference instead."""
    extra = dict(sinks=sinks, window=window)
    if isinstance(meta, RaggedMetadata):
        return _ragged_attention(plan, q[0], k_pages, v_pages, meta, sm_scale, **extra)[None]
    if isinstance(meta, MixedMetadata):
        H, D = q.shape[2:]
        outs, off = [], 0
        for m in meta.segments:
            b, n = m.positions.shape
            qs = q[:, off : off + b * n].reshape(b, n, H, D)
            outs.append(attention(plan, qs, k_pages, v_pages, m, sm_scale=sm_scale, **extra).reshape(1, b * n, H, D))
            off += b * n
        return jax.numpy.concatenate(outs, axis=1)
    backend = shape_fallback("paged_attention", plan.attn, _unsupported(plan.attn, _pa, q.shape[-1], k_pages.dtype))
    oss = sinks is not None or bool(window)
    if oss:  # the GPU kernel takes them (on one device), the TPU kernel not yet
        backend = shape_fallback("paged_attention", backend, _SINKS if isinstance(backend, TPU) or plan.tp > 1
                                 else None)
    if plan.tp > 1 and not isinstance(backend, XLA):
        kvh = k_pages.shape[2]
        backend = shape_fallback("paged_attention", backend, None if kvh % plan.tp == 0 else
                                 f"{kvh} KV heads, replicated over tensor parallel size {plan.tp}")
        if not isinstance(backend, XLA):
            return _sharded_attention(plan, backend, q, k_pages, v_pages, meta, sm_scale)
    if oss:  # the reference or the GPU kernel (above)
        if isinstance(backend, GPU):
            return _pa.kernel_gpu(q, k_pages, v_pages, meta.page_table, meta.kv_lens, meta.positions, meta.causal,
                                  sinks, sm_scale=sm_scale, interpret=backend.interpret, window=window)
        return _pa.ref_paged_attention(q, k_pages, v_pages, meta.page_table, meta.kv_lens, meta.positions,
                                       meta.causal, sinks, sm_scale=sm_scale, window=window)
    return _paged(backend, q, k_pages, v_pages, meta.page_table, meta.kv_lens, meta.positions, meta.causal,
                  sm_scale=sm_scale)


_SINKS = "attention sinks or a sliding window (gpt-oss) are not in this kernel (or its sharded form) yet"


def _unsupported(backend: Backend, kernels, head_dim: int, cache_dtype) -> str | None:
    """Why ``backend``'s kernel in the kernel file ``kernels`` (paged or ragged attention)
    cannot take head_dim or a cache of ``cache_dtype``, or None (XLA takes any)."""
    match backend:
        case GPU():
            return kernels.unsupported_shape_gpu(head_dim)
        case TPU():
            return _pa.FP8_CACHE_TPU if _pa.is_fp8(cache_dtype) else kernels.unsupported_shape_tpu(head_dim)
    return None


def _kernel(kernels, ref, backend: Backend, *args, sm_scale: float):
    """The implementation for ``backend`` in the kernel file ``kernels`` (paged or ragged
    attention: its ``kernel_gpu`` / ``kernel_tpu`` entries), else its jnp reference ``ref``."""
    match backend:
        case GPU(interpret=interpret):
            return kernels.kernel_gpu(*args, sm_scale=sm_scale, interpret=interpret)
        case TPU(interpret=interpret):
            return kernels.kernel_tpu(*args, sm_scale=sm_scale, interpret=interpret)
    return ref(*args, sm_scale=sm_scale)


# (backend, q, the cache, page_table, kv_lens, positions, causal, *, sm_scale)
_paged = functools.partial(_kernel, _pa, _pa.ref_paged_attention)
# (backend, q, the cache, cu_q_lens, kv_lens, page_table, num_seqs, causal, *, sm_scale)
_ragged = functools.partial(_kernel, _rpa, _rpa.ref_ragged_paged_attention)


def _ragged_attention(plan: KernelPlan, q, k_pages, v_pages, meta: RaggedMetadata, sm_scale: float, *, sinks=None,
                      window: int = 0):
    """q [T, H, D] of a flat step over the cache -> [T, H, D]: a decode step's [N, Q] rows
    through paged attention (its kernels, tuned for decode and verification), any other
    step through the ragged kernels on GPU and TPU (per shard of KV heads under tensor
    parallelism); on a CPU both through the loop over sequences (XLA), whose work follows
    kv_len; the gathering reference where an accelerator's kernel cannot take the shape."""
    kvh = k_pages.shape[2]
    on_cpu = isinstance(plan.attn, XLA) and jax.default_backend() == "cpu"
    if meta.uniform and not on_cpu:  # a decode step's [N, Q] rows: paged attention's kernels
        T, H, D = q.shape
        return attention(plan, q.reshape(T // meta.uniform, meta.uniform, H, D), k_pages, v_pages, meta.rows(),
                         sm_scale=sm_scale, sinks=sinks, window=window).reshape(T, H, D)
    backend = shape_fallback("ragged_paged_attention", plan.attn,
                             _unsupported(plan.attn, _rpa, q.shape[-1], k_pages.dtype))
    oss = sinks is not None or bool(window)
    if oss:  # the GPU kernel takes them (on one device), the TPU kernel not yet
        backend = shape_fallback("ragged_paged_attention", backend, _SINKS if isinstance(backend, TPU) or plan.tp > 1
                                 else None)
    if plan.tp > 1 and not isinstance(backend, XLA):
        backend = shape_fallback("ragged_paged_attention", backend, None if kvh % plan.tp == 0 else
                                 f"{kvh} KV heads, replicated over tensor parallel size {plan.tp}")
    args = (meta.cu_q_lens, meta.kv_lens, meta.page_table, meta.num_seqs, meta.causal)
    if isinstance(backend, XLA) and on_cpu:
        short, long = meta.windows
        return ragged_attention_xla(q, k_pages, v_pages, *args, meta.positions[0], sinks, sm_scale=sm_scale,
                                    short=short, long=long, window=window)
    if oss:  # the GPU kernel, or off the CPU the gathering reference (above)
        if isinstance(backend, GPU):
            return _rpa.kernel_gpu(q, k_pages, v_pages, *args, sinks, sm_scale=sm_scale, interpret=backend.interpret,
                                   window=window)
        return _rpa.ref_ragged_paged_attention(q, k_pages, v_pages, *args, sinks, sm_scale=sm_scale, window=window)
    if plan.tp > 1 and not isinstance(backend, XLA):
        heads, rep = P(None, TP_AXIS, None), P()
        local = lambda q, k, v, *a: _ragged(backend, q, k, v, *a, sm_scale=sm_scale)  # noqa: E731
        return jax.shard_map(local, mesh=plan.mesh, in_specs=(heads, _KV_HEADS, _KV_HEADS) + (rep,) * 5,
                             out_specs=heads, check_vma=False)(q, k_pages, v_pages, *args)
    return _ragged(backend, q, k_pages, v_pages, *args, sm_scale=sm_scale)


# The paged cache [P, S, KVH, D] and q [B, Q, H, D] split by (KV) head over the mesh.
_KV_HEADS = P(None, None, TP_AXIS, None)


def _sharded_attention(plan: KernelPlan, backend: Backend, q, k_pages, v_pages, meta: AttentionMetadata,
                       sm_scale: float):
    """The paged-attention kernel once per device under shard_map: q's heads and the cache's
    KV heads split alike over the "tp" axis (tp divides the KV heads), the metadata
    replicated; no collective (each device's heads attend over its own KV heads)."""
    heads, rep = _KV_HEADS, P()

    def local(q, k, v, table, lens, pos, causal):
        return _paged(backend, q, k, v, table, lens, pos, causal, sm_scale=sm_scale)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(heads, heads, heads, rep, rep, rep, rep), out_specs=heads,
                         check_vma=False)(q, k_pages, v_pages, meta.page_table, meta.kv_lens, meta.positions,
                                          meta.causal)
