"""Pallas paged attention == the jnp reference, on ragged batches with poisoned pages.

Every kernel runs on CPU: the GPU (Triton) kernel body with ``interpret=True``, the TPU
kernel with ``pltpu.InterpretParams()``. Batches mix the query modes of the engine
(decode, causal verification, DFlash non-causal blocks, prefill chunks) and empty slots.
Pages no sequence owns are filled with NaN, and page-table entries past a sequence's
pages point at them, so a kernel that reads or mixes in any key it should not see fails.

Padding rows (query tokens past a sequence's real ones, and empty slots with kv_len 0)
follow the reference's rule exactly: a row sees keys j < kv_len with j <= its position
(all j < kv_len for DFlash rows), and a row that sees no key outputs 0. The kernels are
compared on every row, padding included, so they must be finite there too.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import kernel_gpu, kernel_tpu, ref_paged_attention
from kernels_pallas.paged_attention_gpu import NEG_INF, combine_splits, paged_attention_gpu
from kernels_pallas.paged_attention_tpu import paged_attention_tpu

PAGE = 16
D = 128  # TPU tiles need a 128-lane last dim
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_batch(seed, *, q_len, kv_lens, kv_heads, group, dtype, causal, new_tokens=None, num_pages=None):
    """A ragged batch: sequence b holds kv_lens[b] keys and new_tokens[b] real queries.

    The real queries are the last new_tokens[b] positions of the sequence; the remaining
    query slots are padding whose positions continue past kv_len (as the engine pads).
    Returns the arguments of paged_attention after q (all numpy / jnp arrays).
    """
    rng = np.random.default_rng(seed)
    B = len(kv_lens)
    kv_lens = np.asarray(kv_lens, np.int32)
    new_tokens = np.minimum(kv_lens, q_len) if new_tokens is None else np.asarray(new_tokens)
    pages_per_seq = [-(-int(n) // PAGE) for n in kv_lens]
    W = max(max(pages_per_seq), 1) + 2  # spare table columns: junk entries
    used = sum(pages_per_seq)
    P = num_pages or used + 5
    perm = rng.permutation(P)
    owned, junk = perm[:used], perm[used:]
    table = rng.choice(junk, size=(B, W)).astype(np.int32)  # unused entries: poisoned pages
    off = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = owned[off : off + n]
        off += n
    H = kv_heads * group
    k = rng.standard_normal((P, PAGE, kv_heads, D)).astype(np.float32)
    v = rng.standard_normal((P, PAGE, kv_heads, D)).astype(np.float32)
    k[junk] = np.nan
    v[junk] = np.nan
    # Slots past kv_len inside a sequence's last page are poisoned too.
    for b in range(B):
        for t in range(int(kv_lens[b]), pages_per_seq[b] * PAGE):
            k[table[b, t // PAGE], t % PAGE] = np.nan
            v[table[b, t // PAGE], t % PAGE] = np.nan
    q = rng.standard_normal((B, q_len, H, D)).astype(np.float32)
    positions = np.zeros((B, q_len), np.int32)
    for b in range(B):
        first = int(kv_lens[b]) - int(new_tokens[b])
        positions[b] = first + np.arange(q_len)
    causal_arr = np.asarray(causal, bool) if causal is not None else None
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(table),
        jnp.asarray(kv_lens),
        jnp.asarray(positions),
        None if causal_arr is None else jnp.asarray(causal_arr),
    )
    return args


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


# (name, q_len, kv_lens, new_tokens, causal): every mode plus empty slots.
MODES = [
    ("decode", 1, [37, 0, 64, 5], [1, 0, 1, 1], None),
    ("verify8", 8, [40, 9, 0, 70], [8, 8, 0, 3], [True, True, True, True]),
    ("dflash", 8, [24, 50, 8, 0], [8, 8, 8, 0], [False, False, True, False]),
    ("prefill32", 32, [45, 32, 0], [32, 20, 0], None),
]


def run_impl(impl, args, sm_scale, **tuning):
    q, k, v, pt, kl, pos, causal = args
    if impl == "interpret":
        return paged_attention_gpu(q, k, v, pt, kl, pos, causal, sm_scale=sm_scale, interpret=True, **tuning)
    if impl == "tpu_interpret":
        return paged_attention_tpu(q, k, v, pt, kl, pos, causal, sm_scale=sm_scale, interpret=True, **tuning)
    raise ValueError(impl)


@pytest.mark.parametrize("impl", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("group,dtype", [(1, jnp.float32), (4, jnp.bfloat16)], ids=["g1-f32", "g4-bf16"])
def test_kernel_matches_reference(impl, mode, group, dtype):
    name, q_len, kv_lens, new_tokens, causal = mode
    args = make_batch(sum(map(ord, name)), q_len=q_len, kv_lens=kv_lens, kv_heads=2, group=group,
                      dtype=dtype, causal=causal, new_tokens=new_tokens)
    sm_scale = D**-0.5
    ref = ref_paged_attention(*args, sm_scale=sm_scale)
    assert np.isfinite(np.asarray(ref, np.float32)).all()
    out = run_impl(impl, args, sm_scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize(
    "impl,tuning",
    [
        ("interpret", dict(kv_splits=3, block_kv=16)),  # splits + combine, blocks smaller than a page
        ("interpret", dict(kv_splits=1, block_rows=16)),  # several row blocks, in-kernel normalisation
        ("tpu_interpret", dict(pages_per_block=2, block_rows=16)),  # several kv steps and row blocks
    ],
)
def test_tuning_variants(impl, tuning):
    args = make_batch(7, q_len=32, kv_lens=[70, 33, 0], kv_heads=2, group=4, dtype=jnp.float32,
                      causal=[True, False, True], new_tokens=[32, 16, 0])
    ref = ref_paged_attention(*args, sm_scale=0.1)
    assert rel_err(run_impl(impl, args, 0.1, **tuning), ref) < TOL[jnp.float32]


@pytest.mark.parametrize("splits,dtype", [(3, jnp.float32), (5, jnp.bfloat16)])
def test_split_combine_kernel_matches_jnp(splits, dtype):
    """The Pallas split combine == the jnp combine, incl. splits that saw no key (lse =
    NEG_INF, zero output) and a row no split saw (a zero row, as the reference gives)."""
    rng = np.random.default_rng(splits)
    rows = 7  # 6 real rows + the kernel's trash row
    o_s = rng.standard_normal((splits, rows, D)).astype(np.float32)
    lse = (3 * rng.standard_normal((splits, rows))).astype(np.float32)
    lse[1, 2] = NEG_INF  # one split saw nothing for row 2
    o_s[1, 2] = 0.0
    lse[:, 4] = NEG_INF  # no split saw anything for row 4
    o_s[:, 4] = 0.0
    o_s, lse = jnp.asarray(o_s, dtype), jnp.asarray(lse)
    out = combine_splits(o_s, lse, rows - 1, dtype, kernel=True, interpret=True)
    ref = combine_splits(o_s, lse, rows - 1, dtype, kernel=False)
    assert out.shape == (rows - 1, D) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert not np.asarray(out[4], np.float32).any()


ENTRIES = {"reference": ref_paged_attention, "gpu-interpret": functools.partial(kernel_gpu, interpret=True),
           "tpu-interpret": functools.partial(kernel_tpu, interpret=True)}


@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES)
def test_public_entries(entry):
    """The public entries (jspec.ops_attention picks one by the plan's backend) take q in
    another dtype than the cache: the kernels run in the cache dtype, the output in q's."""
    args = make_batch(3, q_len=8, kv_lens=[20, 40], kv_heads=2, group=2, dtype=jnp.bfloat16,
                      causal=[True, False], new_tokens=[8, 8])
    q = args[0].astype(jnp.float32)  # q in f32, cache in bf16: kernels run in the cache dtype
    out = entry(q, *args[1:], sm_scale=D**-0.5)
    ref = ref_paged_attention(*args, sm_scale=D**-0.5)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


def test_validation_messages():
    args = make_batch(0, q_len=1, kv_lens=[5], kv_heads=1, group=1, dtype=jnp.float32, causal=None)
    with pytest.raises(ValueError, match="block_kv"):
        paged_attention_gpu(*args, sm_scale=1.0, block_kv=24, interpret=True)
    with pytest.raises(ValueError, match="split_combine"):
        paged_attention_gpu(*args, sm_scale=1.0, split_combine="xla", interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        paged_attention_tpu(*args, sm_scale=1.0, block_rows=8, interpret=True)
    q, k, v, *meta = args
    with pytest.raises(ValueError, match="paged_attention: head_dim 64 is not a multiple of 128"):
        kernel_tpu(q[..., :64], k[..., :64], v[..., :64], *meta, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="paged_attention: head_dim 24 is not a power of 2"):
        kernel_gpu(q[..., :24], k[..., :24], v[..., :24], *meta, sm_scale=1.0, interpret=True)


def test_sinks_and_window_match_the_ragged_reference():
    """gpt-oss's sinks and sliding window in the [B, Q] reference equal the flat one's
    (tests/kernels/test_ragged_paged_attention.py checks that against a dense float64 loop)."""
    from kernels_pallas.ragged_paged_attention import ref_ragged_paged_attention

    B, Q = 3, 4
    q, k, v, table, kv_lens, positions, _ = make_batch(7, q_len=Q, kv_lens=[9, 40, 70], kv_heads=2, group=2,
                                                       dtype=jnp.float32, causal=None)
    sinks = jnp.asarray(np.random.default_rng(1).normal(0, 2, 4), jnp.float32)
    flat = (q.reshape(B * Q, 4, D), k, v, jnp.arange(B + 1, dtype=jnp.int32) * Q, kv_lens, table,
            jnp.asarray([B], jnp.int32), None)
    for window in (0, 20):
        got = ref_paged_attention(q, k, v, table, kv_lens, positions, None, sinks, sm_scale=0.1, window=window)
        want = ref_ragged_paged_attention(*flat, sinks, sm_scale=0.1, window=window)
        assert rel_err(got.reshape(B * Q, 4, D), want) < 1e-6, window


@pytest.mark.parametrize("tuning", [dict(kv_splits=1), dict(kv_splits=3, block_kv=16),
                                    dict(kv_splits=3, block_kv=16, split_combine="jnp"),
                                    dict(kv_splits=1, block_kv=16, block_rows=16)],
                         ids=["one-split", "splits", "splits-jnp-combine", "row-blocks"])
@pytest.mark.parametrize("window", [0, 20])
def test_gpu_kernel_takes_sinks_and_window(tuning, window):
    """gpt-oss on the GPU kernel (interpreted): each head's sink joins the softmax (in the
    kernel with one split, in the combine with several) and the window's start skips keys;
    verify rows, a DFlash row, a decode row and an empty slot, against the reference."""
    args = make_batch(11, q_len=8, kv_lens=[70, 33, 9, 0], kv_heads=2, group=2, dtype=jnp.float32,
                      causal=[True, False, True, True], new_tokens=[8, 8, 1, 0])
    sinks = jnp.asarray(np.random.default_rng(2).normal(0, 2, 4), jnp.float32)
    ref = ref_paged_attention(*args, sinks, sm_scale=0.1, window=window)
    out = paged_attention_gpu(*args, sinks, sm_scale=0.1, window=window, interpret=True, **tuning)
    assert rel_err(out, ref) < TOL[jnp.float32]
    assert rel_err(ref, ref_paged_attention(*args, sm_scale=0.1, window=window)) > 1e-2  # the sinks mattered
    # the model's bf16 sinks, as ops.attention passes them: read as f32 in the kernels, the
    # same softmax as their f32 values give
    sinks16 = sinks.astype(jnp.bfloat16)
    out16 = paged_attention_gpu(*args, sinks16, sm_scale=0.1, window=window, interpret=True, **tuning)
    ref16 = ref_paged_attention(*args, sinks16.astype(jnp.float32), sm_scale=0.1, window=window)
    assert rel_err(out16, ref16) < TOL[jnp.float32]
