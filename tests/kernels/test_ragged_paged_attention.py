"""Ragged paged attention over a flat token batch (kernels_pallas/ragged_paged_attention.py).

The reference is checked against an independent dense computation (numpy, float64, one
sequence at a time); the kernels against the reference on CPU: the GPU (Triton) kernel
body with ``interpret=True``, the TPU kernel with ``pltpu.InterpretParams()``.

A step mixes every segment kind of the engine: decode tokens, causal verification,
DFlash's non-causal blocks, prefill chunks (first and later), an empty segment, padding
tokens past the last segment, and metadata rows past num_seqs holding junk. Pages no
sequence owns, and slots past kv_len in a sequence's last page, are NaN; page-table
entries past a sequence's pages point at NaN pages or hold out-of-range ids; so a kernel
that reads or mixes in a key it should not see fails. Every output row is compared,
padding included (zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.ragged_paged_attention import kernel_gpu, kernel_tpu, ref_ragged_paged_attention
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

PAGE = 16
D = 128  # TPU tiles need a 128-lane last dim
KVH = 2
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (q_len, kv_len, causal) per sequence: decode, verify, DFlash block, prefill chunks, an
# empty segment, a causal block longer than its keys (its first queries see nothing).
# One jit per call: an eager reference costs seconds of op-by-op compiles on CPU.
ref_attention = jax.jit(ref_ragged_paged_attention, static_argnames="sm_scale")

MIX = [(1, 37), (4, 20, True), (8, 24, False), (19, 19), (1, 70), (0, 5), (13, 45), (3, 2)]
SMALL = [(1, 9), (5, 33), (6, 6, False)]


def make_step(seed, segments, *, num_tokens, max_seqs, group, dtype):
    """The arguments of ragged_paged_attention for ``segments`` [(q_len, kv_len[, causal])].

    num_tokens (T) and max_seqs (N) are the buckets: tokens past the segments are padding,
    metadata rows past len(segments) hold junk that must be ignored.
    """
    rng = np.random.default_rng(seed)
    ns = len(segments)
    q_lens = np.array([s[0] for s in segments], np.int32)
    kv_lens = np.array([s[1] for s in segments], np.int32)
    causal = np.array([s[2] if len(s) > 2 else True for s in segments], bool)
    assert q_lens.sum() <= num_tokens and ns <= max_seqs
    pages = [-(-int(n) // PAGE) for n in kv_lens]
    W = max(pages) + 2  # spare table columns: junk entries
    P = sum(pages) + 5
    perm = rng.permutation(P)
    owned, junk = perm[: sum(pages)], perm[sum(pages):]
    table = rng.choice(junk, size=(max_seqs, W)).astype(np.int32)  # unused entries: poisoned pages
    table[0, -1] = P + 3  # an out-of-range junk entry: ids are clipped, never trusted
    off = 0
    for i, n in enumerate(pages):
        table[i, :n] = owned[off: off + n]
        off += n
    k = rng.standard_normal((P, PAGE, KVH, D)).astype(np.float32)
    v = rng.standard_normal((P, PAGE, KVH, D)).astype(np.float32)
    k[junk] = v[junk] = np.nan
    for i in range(ns):  # slots past kv_len in the last page
        for t in range(int(kv_lens[i]), pages[i] * PAGE):
            k[table[i, t // PAGE], t % PAGE] = v[table[i, t // PAGE], t % PAGE] = np.nan
    cu = np.full(max_seqs + 1, num_tokens + 7, np.int32)  # junk past num_seqs
    cu[: ns + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_all = np.full(max_seqs, 10**6, np.int32)  # junk past num_seqs
    kv_all[:ns] = kv_lens
    causal_all = rng.random(max_seqs) < 0.5
    causal_all[:ns] = causal
    q = rng.standard_normal((num_tokens, KVH * group, D)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(cu),
            jnp.asarray(kv_all), jnp.asarray(table), jnp.asarray([ns], jnp.int32), jnp.asarray(causal_all))


def dense_attention(args, sm_scale, sinks=None, window=0):
    """Independent float64 check: per sequence, gather its keys, masked softmax (gpt-oss:
    the ``window`` keys up to the last visible one; each head's sink logit in the denominator)."""
    q, k, v, cu, kv_lens, table, num_seqs, causal = (np.asarray(a, np.float64) if i < 3 else np.asarray(a)
                                                     for i, a in enumerate(args))
    T, H, _ = q.shape
    G = H // k.shape[2]
    out = np.zeros_like(q)
    for i in range(int(num_seqs[0])):
        q_len, kv_len = int(cu[i + 1] - cu[i]), int(kv_lens[i])
        own = table[i, : -(-kv_len // PAGE)]  # the sequence's pages, no junk entries
        keys = k[own].reshape(-1, k.shape[2], D)[:kv_len]  # [kv_len, KVH, D]
        vals = v[own].reshape(-1, k.shape[2], D)[:kv_len]
        for j in range(q_len):
            t = int(cu[i]) + j
            n_vis = kv_len if not causal[i] else max(0, min(kv_len, kv_len - q_len + j + 1))
            if n_vis == 0:
                continue
            lo = max(0, n_vis - window) if window else 0
            for h in range(H):
                s = keys[lo:n_vis, h // G] @ q[t, h] * sm_scale
                m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
                p = np.exp(s - m)
                denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                out[t, h] = p @ vals[lo:n_vis, h // G] / denom
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def test_reference_matches_dense():
    args = make_step(0, MIX, num_tokens=56, max_seqs=10, group=2, dtype=jnp.float32)
    ref = np.asarray(ref_attention(*args, sm_scale=D**-0.5))
    dense = dense_attention(args, D**-0.5)
    assert rel_err(ref, dense) < 1e-5
    assert not ref[49:].any()  # padding tokens (the segments end at 49) are zeros
    # All causal (causal=None) on a step without DFlash blocks.
    args = make_step(1, SMALL[:2], num_tokens=8, max_seqs=3, group=1, dtype=jnp.float32)
    causal_none = (*args[:7], None)
    assert rel_err(ref_attention(*causal_none, sm_scale=0.3), dense_attention(args, 0.3)) < 1e-5


def run_kernel(impl, args, sm_scale, **tuning):
    if impl == "interpret":
        return ragged_paged_attention_gpu(*args, sm_scale=sm_scale, interpret=True, **tuning)
    return ragged_paged_attention_tpu(*args, sm_scale=sm_scale, interpret=True, **tuning)


# (impl, group, dtype, tuning). GPU: the defaults (GQA 4: 8 tokens per program, 2 kv
# splits), then 4-token programs, 16-key steps, 3 splits. TPU: 32-token blocks (4 pages per
# kv step: fewer unrolled DMAs to compile than the default 8), then 16-token blocks of 2
# pages per step. Either TPU tuning has blocks spanning several sequences and sequences
# spanning several blocks and kv steps. bf16 steps are padded (T = 56 > 49 tokens, N = 10 >
# 8 sequences); f32 steps are full (T = 49, num_seqs = N = 8: no padding token, no junk row).
CASES = [
    ("interpret", 4, jnp.bfloat16, {}),
    ("interpret", 1, jnp.float32, dict(block_q=4, block_kv=16, kv_splits=3)),
    ("tpu_interpret", 4, jnp.bfloat16, dict(pages_per_block=4)),
    ("tpu_interpret", 1, jnp.float32, dict(block_q=16, pages_per_block=2)),
]


@pytest.mark.parametrize("impl,group,dtype,tuning", CASES,
                         ids=[f"{c[0]}-g{c[1]}-{jnp.dtype(c[2]).name}" for c in CASES])
def test_kernel_matches_reference(impl, group, dtype, tuning):
    T, N = (56, 10) if dtype == jnp.bfloat16 else (49, 8)
    args = make_step(2, MIX, num_tokens=T, max_seqs=N, group=group, dtype=dtype)
    ref = ref_attention(*args, sm_scale=D**-0.5)
    out = run_kernel(impl, args, D**-0.5, **tuning)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert not np.asarray(out[49:], np.float32).any()  # padding tokens: zeros


@pytest.mark.parametrize("entry", [ref_ragged_paged_attention, functools.partial(kernel_gpu, interpret=True)],
                         ids=["reference", "gpu-interpret"])
def test_public_entries(entry):
    """The reference and the GPU kernel's public entry (its body, interpreted); q in f32
    over a bf16 cache: kernels run in the cache dtype. (Which kernel kernel_gpu and
    kernel_tpu reach: tests/kernels/test_lowering.py.)"""
    args = make_step(3, SMALL, num_tokens=16, max_seqs=4, group=2, dtype=jnp.bfloat16)
    q = args[0].astype(jnp.float32)
    out = entry(q, *args[1:], sm_scale=D**-0.5)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref_attention(*args, sm_scale=D**-0.5)) < TOL[jnp.bfloat16]


def test_validation_messages():
    args = make_step(4, SMALL[:1], num_tokens=4, max_seqs=2, group=1, dtype=jnp.float32)
    q, k, v, cu, kv, table, ns, causal = args
    with pytest.raises(ValueError, match="cu_q_lens must have shape"):
        ref_ragged_paged_attention(q, k, v, cu[:-1], kv, table, ns, causal, sm_scale=1.0)
    with pytest.raises(ValueError, match="num_seqs must have shape"):
        kernel_gpu(q, k, v, cu, kv, table, jnp.asarray(1), causal, sm_scale=1.0)
    with pytest.raises(ValueError, match="causal must be bool"):
        kernel_tpu(q, k, v, cu, kv, table, ns, causal.astype(jnp.int32), sm_scale=1.0)
    with pytest.raises(ValueError, match="block_kv must be a power of 2"):
        ragged_paged_attention_gpu(*args, sm_scale=1.0, block_kv=24, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_tpu(*args, sm_scale=1.0, block_q=8, interpret=True)
    with pytest.raises(ValueError, match="multiple of page_size"):
        kernel_tpu(*args, sm_scale=1.0, interpret=True, block_kv=24)
    with pytest.raises(ValueError, match="ragged_paged_attention: head_dim 64 is not a multiple of 128"):
        kernel_tpu(q[..., :64], k[..., :64], v[..., :64], cu, kv, table, ns, causal, sm_scale=1.0, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_loop_matches_the_reference(dtype):
    """The CPU path (kernels_pallas/ragged_attention_xla.py): windows of 4 (short) and 32
    (long) queries, keys in blocks of 2 pages, on the poisoned mix."""
    from kernels_pallas.ragged_attention_xla import ragged_attention_xla

    args = make_step(3, MIX, num_tokens=64, max_seqs=10, group=2, dtype=dtype)
    want = ref_attention(*args, sm_scale=0.1)
    got = ragged_attention_xla(*args, sm_scale=0.1, short=4, long=32, block_kv=2 * PAGE)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=TOL[dtype],
                               atol=TOL[dtype])


def test_sinks_and_sliding_window():
    """gpt-oss's attention: each head's sink joins the softmax, a query sees the ``window``
    keys up to its last; the reference against the dense check, the CPU loop (keys in blocks
    of 2 pages: the blocks before every window are skipped) against the reference."""
    from kernels_pallas.ragged_attention_xla import ragged_attention_xla

    args = make_step(5, MIX, num_tokens=64, max_seqs=10, group=2, dtype=jnp.float32)
    sinks = jnp.asarray(np.random.default_rng(0).normal(0, 2, KVH * 2), jnp.float32)
    for window in (0, 20):
        want = dense_attention(args, 0.1, np.asarray(sinks), window)
        ref = jax.jit(ref_ragged_paged_attention, static_argnames=("sm_scale", "window"))(
            *args, sinks, sm_scale=0.1, window=window)
        assert rel_err(ref, want) < 1e-5, window
        got = ragged_attention_xla(*args, sm_scale=0.1, short=4, long=32, block_kv=2 * PAGE, window=window,
                                   sinks=sinks)
        assert rel_err(got, want) < 1e-5, window
    assert rel_err(ref, dense_attention(args, 0.1, np.asarray(sinks))) > 1e-2  # the window mattered
    assert rel_err(ref, dense_attention(args, 0.1, None, window)) > 1e-2  # and the sinks


@pytest.mark.parametrize("tuning", [dict(kv_splits=1), dict(kv_splits=3, block_kv=16)], ids=["one-split", "splits"])
def test_gpu_kernel_takes_sinks_and_window(tuning):
    """gpt-oss on the GPU kernel (interpreted), on the poisoned mix, against the reference."""
    args = make_step(6, MIX, num_tokens=64, max_seqs=10, group=2, dtype=jnp.float32)
    sinks = jnp.asarray(np.random.default_rng(3).normal(0, 2, KVH * 2), jnp.float32)
    for window in (0, 20):
        want = ref_ragged_paged_attention(*args, sinks, sm_scale=0.1, window=window)
        got = ragged_paged_attention_gpu(*args, sinks, sm_scale=0.1, window=window, block_q=4, interpret=True,
                                         **tuning)
        assert rel_err(got, want) < TOL[jnp.float32], window
