"""An FP8 KV cache (float8_e4m3fn pages, vLLM's kv_cache_dtype="fp8" at scales of 1.0) on
CPU, the GPU kernels in Pallas' interpreter:

- writing rounds to e4m3 and saturates at +-448 (kv_store; a plain cast would give NaN),
  the same in the XLA scatter (write_kv), the RoPE + KV-write kernel and the one-kernel
  qkv + RoPE + KV write;
- attention over FP8 pages == attention over bf16 pages holding the same (e4m3) values, bit
  for bit, for the references, the GPU kernels (paged and ragged) and the CPU path: the
  values are converted to the queries' dtype as they are read;
- the TPU kernels refuse FP8 pages by name (jspec.ops.attention runs XLA there instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import paged_attention as pa
from kernels_pallas import ragged_paged_attention as rpa
from kernels_pallas.fused_linear import fused_linear_gpu
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write_gpu
from kernels_pallas.ragged_attention_xla import ragged_attention_xla
from kernels_pallas.rope_kv_write import ref_rope_kv_write, rope_kv_write, rope_tables
from tests.kernels.test_paged_attention import MODES, make_batch
from tests.kernels.test_ragged_paged_attention import MIX, PAGE, make_step

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def as_fp8(pages):
    """(the pages in FP8, the same values in bf16): NaN poison kept, values within e4m3's range."""
    p8 = pa.kv_store(pages, FP8)
    return p8, p8.astype(BF16)


def test_kv_store_rounds_and_saturates():
    x = jnp.array([0.3, -1.7, 447.0, 460.0, 1e4, -3e5, 2.0 ** -10, 0.0], BF16)
    got = pa.kv_store(x, FP8)
    assert got.dtype == FP8 and not np.isnan(f32(got)).any()
    want = np.clip(np.asarray(x, np.float32), -448, 448).astype(FP8)  # ml_dtypes' rounding, saturated
    np.testing.assert_array_equal(f32(got), want.astype(np.float32))
    assert f32(got)[3:6].tolist() == [448.0, 448.0, -448.0]
    assert np.isnan(f32(x.astype(FP8))[4])  # what a plain cast would store
    np.testing.assert_array_equal(f32(pa.kv_store(x, BF16)), f32(x))  # other caches: a cast


@pytest.mark.parametrize("mode", [MODES[0], MODES[1]], ids=[MODES[0][0], MODES[1][0]])
@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_paged_attention_reads_fp8_pages(mode, impl):
    _, q_len, kv_lens, new, causal = mode
    q, k, v, *meta = make_batch(1, q_len=q_len, kv_lens=kv_lens, kv_heads=2, group=4, dtype=jnp.float32,
                                causal=causal, new_tokens=new)
    q = q.astype(BF16)
    (k8, kb), (v8, vb) = as_fp8(k), as_fp8(v)
    fn = (pa.ref_paged_attention if impl == "reference"
          else lambda *a, **kw: pa.kernel_gpu(*a, interpret=True, **kw))
    got, want = fn(q, k8, v8, *meta, sm_scale=0.1), fn(q, kb, vb, *meta, sm_scale=0.1)
    assert got.dtype == BF16
    np.testing.assert_array_equal(f32(got), f32(want))
    exact = fn(q, k.astype(BF16), v.astype(BF16), *meta, sm_scale=0.1)  # the unrounded cache, for scale
    finite = np.isfinite(f32(exact))
    assert np.abs(f32(got) - f32(exact))[finite].max() < 0.15


@pytest.mark.parametrize("impl", ["reference", "gpu", "xla"])
def test_ragged_attention_reads_fp8_pages(impl):
    q, k, v, *meta = make_step(2, MIX, num_tokens=64, max_seqs=10, group=2, dtype=jnp.float32)
    q = q.astype(BF16)
    (k8, kb), (v8, vb) = as_fp8(k), as_fp8(v)
    if impl == "reference":
        fn = jax.jit(rpa.ref_ragged_paged_attention, static_argnames="sm_scale")
    elif impl == "gpu":
        fn = lambda *a, **kw: rpa.kernel_gpu(*a, interpret=True, **kw)  # noqa: E731
    else:
        fn = lambda *a, **kw: ragged_attention_xla(*a, **kw, short=4, long=32, block_kv=2 * PAGE)  # noqa: E731
    got, want = fn(q, k8, v8, *meta, sm_scale=0.1), fn(q, kb, vb, *meta, sm_scale=0.1)
    if impl == "xla":  # it converts every key and value to f32 as it reads them: bit for bit too
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    np.testing.assert_array_equal(f32(got), f32(want))


def test_tpu_kernels_refuse_fp8_pages():
    q, k, v, *meta = make_step(2, MIX, num_tokens=64, max_seqs=10, group=2, dtype=BF16)
    with pytest.raises(ValueError, match="an FP8 KV cache: the TPU kernels read 16/32-bit pages"):
        rpa.kernel_tpu(q, pa.kv_store(k, FP8), pa.kv_store(v, FP8), *meta, sm_scale=0.1, interpret=True)


def test_writers_store_fp8():
    """Each KV writer into FP8 pages == the same writer into bf16 pages, then kv_store: values
    past 448 saturate (a row scaled up so some do)."""
    H, KVH, D, P, S, K = 4, 2, 32, 6, 8, 256
    ks = jax.random.split(jax.random.PRNGKey(21), 6)
    kp, vp = (jax.random.normal(k, (P, S, KVH, D)).astype(BF16) for k in ks[:2])
    kp8, vp8 = pa.kv_store(kp, FP8), pa.kv_store(vp, FP8)
    cos, sin = rope_tables(jnp.array([29, 30]), 1.0 / (10000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    slots = jnp.array([19, 3], jnp.int32)
    qkv = (jax.random.normal(ks[2], (2, (H + 2 * KVH) * D)) * jnp.array([[1.0], [400.0]])).astype(BF16)

    def check(fn):  # fn(k_pages, v_pages) -> (q, k_pages, v_pages)
        q8, k8, v8 = fn(kp8, vp8)
        qb, kb, vb = fn(kp, vp)
        np.testing.assert_array_equal(f32(q8), f32(qb))
        for a, b in ((k8, kb), (v8, vb)):
            assert a.dtype == FP8 and not np.isnan(f32(a)).any()
            np.testing.assert_array_equal(f32(a), f32(pa.kv_store(b, FP8)))
        assert np.abs(f32(v8)).max() == 448.0  # saturated, not NaN

    check(lambda kp, vp: ref_rope_kv_write(qkv, cos, sin, slots, kp, vp, num_heads=H))
    check(lambda kp, vp: rope_kv_write(qkv, cos, sin, slots, kp, vp, num_heads=H, interpret=True))
    # the one-kernel qkv + RoPE + KV write (one token): against the projection kernel and the reference's write
    x = (2 * jax.random.normal(ks[3], (1, K))).astype(BF16)
    w = (40 * jax.random.normal(ks[4], ((H + 2 * KVH) * D, K))).astype(BF16)  # large: some values saturate
    nw = jnp.ones((K,), BF16)
    blocks = (4, 128, 4, 4, False)

    def one_kernel(kp, vp):
        return qkv_rope_kv_write_gpu(x, w, nw, None, cos[:1], sin[:1], slots[:1], kp, vp, num_heads=H, eps=1e-5,
                                     blocks=blocks, interpret=True)

    def two_steps(kp, vp):
        y = fused_linear_gpu(x, w, nw, prologue="rmsnorm", eps=1e-5, blocks=blocks, interpret=True)
        return ref_rope_kv_write(y, cos[:1], sin[:1], slots[:1], kp, vp, num_heads=H)

    check(one_kernel)
    for a, b in zip(one_kernel(kp8, vp8), two_steps(kp8, vp8)):
        np.testing.assert_array_equal(f32(a), f32(b))


def test_ops_attention_over_fp8_pages_on_the_tpu_plan_runs_xla():
    """With the TPU kernels' plan an FP8 cache's attention takes XLA's reference (one log
    line, kernel_backend.shape_fallback), not an error."""
    from jspec import ops
    from jspec.kv_cache import AttentionMetadata

    _, q_len, kv_lens, new, causal = MODES[1]
    q, k, v, table, lens, pos, caus = make_batch(1, q_len=q_len, kv_lens=kv_lens, kv_heads=2, group=4,
                                                 dtype=jnp.float32, causal=causal, new_tokens=new)
    meta = AttentionMetadata(page_table=table, kv_lens=lens, positions=pos, slot_mapping=jnp.zeros_like(pos),
                             causal=caus)
    k8, v8 = pa.kv_store(k, FP8), pa.kv_store(v, FP8)
    q = q.astype(BF16)
    got = ops.attention(ops.KernelPlan(attn=ops.TPU(interpret=True)), q, k8, v8, meta, sm_scale=0.1)
    want = pa.ref_paged_attention(q, k8, v8, table, lens, pos, caus, sm_scale=0.1)
    np.testing.assert_array_equal(f32(got), f32(want))
