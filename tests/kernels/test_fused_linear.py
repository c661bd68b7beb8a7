"""Fused small-batch projections (kernels_pallas/fused_linear.py) and RoPE + KV write
(kernels_pallas/rope_kv_write.py): kernel == reference on CPU (Pallas interpret mode), the
references == the model's unfused ops, and a decoder with the kernels == one without.

Both kernels serve the batch-1 decode step on GPU; the engine runs the references
elsewhere, so the references are checked against the plain ops they replaced
(rms_norm -> einsum -> + residual; apply_rope + write_kv) and the kernels against them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from jspec.config import ModelConfig, RopeConfig
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import apply_rope, rope_inv_freq
from jspec.models.transformer import Transformer
from jspec.ops import GPU, TPU, KernelPlan, plan_kernels, plan_params
from kernels_pallas.fused_linear import (
    default_mma_blocks,
    fused_linear,
    fused_linear_gpu,
    k_block,
    one_row_blocks,
    ref_fused_linear,
    rms_norm,
    stream_rows,
)
from kernels_pallas.paged_attention import write_kv
from kernels_pallas.qkv_rope_kv_write import kernel_blocks as qkv_kernel_blocks
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write, qkv_rope_kv_write_gpu, ref_qkv_rope_kv_write
from kernels_pallas.rope_kv_write import ref_rope_kv_write, rope_kv_write, rope_tables

BF16 = jnp.bfloat16
INTERPRET = KernelPlan(linear=GPU(interpret=True))  # the GPU kernel bodies, in Pallas' interpreter


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def rel(a, b):
    return float(np.max(np.abs(f32(a) - f32(b))) / (np.max(np.abs(f32(b))) + 1e-12))


def linear_inputs(seed, F, K, prologue, dtype, *, bias=False, residual=False):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    kin = 2 * K if prologue == "silu_mul" else K
    x = (2 * jax.random.normal(k[0], (1, 1, kin))).astype(dtype)
    w = (0.05 * jax.random.normal(k[1], (F, K))).astype(dtype)
    kw = dict(prologue=prologue, eps=1e-5)
    if prologue == "rmsnorm":
        kw["norm_w"] = (1 + 0.1 * jax.random.normal(k[2], (K,))).astype(dtype)
    if bias:
        kw["bias"] = (0.1 * jax.random.normal(k[3], (F,))).astype(dtype)
    if residual:
        kw["residual"] = jax.random.normal(k[4], (1, 1, F)).astype(dtype)
    return x, w, kw


# The tensor-core weight stream's tiles for the small test weights (by default only 8B widths
# take it: kernels_pallas/tuning.py), so that both streams are checked at every prologue.
MMA_TILE = (32, 128, 4, 4, True)


@pytest.mark.parametrize("dtype,blocks", [(BF16, None), (BF16, MMA_TILE), (jnp.float32, None)])
@pytest.mark.parametrize("prologue,bias,residual", [
    ("rmsnorm", False, False), ("rmsnorm", True, False), ("none", False, True), ("silu_mul", False, True),
    ("silu_mul", True, True),
])
def test_fused_linear_kernel_matches_reference(prologue, bias, residual, dtype, blocks):
    x, w, kw = linear_inputs(1, 96, 256, prologue, dtype, bias=bias, residual=residual)
    assert ops.linear_kernel(INTERPRET, 1, w.shape, fused=True)
    got = fused_linear(x, w, interpret=True, blocks=blocks, **kw)
    want = ref_fused_linear(x, w, **kw)
    assert got.shape == want.shape == (1, 1, 96) and got.dtype == want.dtype
    # bf16: the RMSNorm is factored out of the dot (x * w_norm in bf16, 1/rms applied to
    # the f32 sum), so values may differ by a couple of bf16 ulps; f32: summation order.
    assert rel(got, want) < (2e-2 if dtype == BF16 else 1e-5)


def test_fused_linear_reference_is_the_unfused_ops():
    x, w, kw = linear_inputs(2, 64, 128, "rmsnorm", BF16, residual=True)
    want = kw["residual"] + jnp.einsum("...d,fd->...f", rms_norm(x, kw["norm_w"], 1e-5), w)
    np.testing.assert_array_equal(f32(ref_fused_linear(x, w, **kw)), f32(want))
    x, w, kw = linear_inputs(3, 64, 128, "silu_mul", BF16)
    g, u = jnp.split(x, 2, axis=-1)
    np.testing.assert_array_equal(f32(ref_fused_linear(x, w, **kw)), f32(jnp.einsum("...d,fd->...f", jax.nn.silu(g) * u, w)))


@pytest.mark.parametrize("prologue", ["rmsnorm", "silu_mul", "none"])
@pytest.mark.parametrize("dtype,blocks", [(BF16, (32, 128, 4, 4, True)), (BF16, (8, 128, 4, 2)),
                                          (jnp.float32, (16, 256, 4, 2))])
def test_fused_linear_masks_a_last_partial_chunk(prologue, dtype, blocks):
    """K = 352 in chunks of 128 or 256: the last chunk's loads past K are masked to zeros
    (k_block's choice for gpt-oss's K = 2880); == the reference and == a tiling that divides K."""
    x, w, kw = linear_inputs(6, 64, 352, prologue, dtype, bias=True, residual=True)
    want = ref_fused_linear(x, w, **kw)
    got = fused_linear(x, w, interpret=True, blocks=blocks, **kw)
    assert rel(got, want) < (2e-2 if dtype == BF16 else 1e-5)
    divides = fused_linear(x, w, interpret=True, blocks=(blocks[0], 32, *blocks[2:]), **kw)
    assert rel(got, divides) < (2e-2 if dtype == BF16 else 1e-5)


def test_k_block_masks_a_tail_only_where_no_long_chunk_divides():
    assert k_block(4096, 512) == 512 and k_block(14336, 1024) == 1024 and k_block(768, 512) == 256
    assert k_block(2880, 512) == 512 and k_block(2880, 256) == 256  # 2880 = 2^6 * 45: 64s only
    assert k_block(320, 512) == 64  # shorter than one chunk
    assert k_block(100, 512) == 0 and k_block(2888, 512) == 0  # rows not 32-byte aligned: no kernel


def test_fused_linear_block_tilings_agree():
    """Other tilings than the default (a sweep's candidates) compute the same thing."""
    x, w, kw = linear_inputs(4, 64, 512, "silu_mul", BF16, residual=True)
    want = ref_fused_linear(x, w, **kw)
    for blocks in [(8, 128, 4, 2), (16, 512, 8, 3), (32, 256, 4, 4), (16, 128, 4, 2, True), (64, 256, 4, 4, True)]:
        got = fused_linear_gpu(x[0], w, None, None, kw["residual"][0], prologue="silu_mul", eps=1e-5,
                               blocks=blocks, interpret=True)
        assert rel(got, want[0]) < 2e-2, blocks


@pytest.mark.parametrize("dtype,F,mma", [(BF16, 128, False), (BF16, 128, True), (BF16, 96, False),
                                         (jnp.float32, 128, False)])
def test_norm_handoff_kernels_match_reference_and_the_unfused_mlp(dtype, F, mma):
    """The post-attention RMSNorm handed over from o_proj to down_proj: o_proj's kernel
    writes h (bit for bit the plain kernel's), h * norm_w and per-program sums of h^2 (96
    features: 3 programs, padded to 4 for the consumer); down_proj's kernel applies 1 / rms
    to the gate|up values == its reference; and the chain == rms_norm -> gate_up -> SwiGLU ->
    down, all three against the same float32 maths within the unfused path's own error."""
    I = 128
    k = jax.random.split(jax.random.PRNGKey(11), 6)
    a = jax.random.normal(k[0], (1, 1, 64)).astype(dtype)
    res = jax.random.normal(k[1], (1, 1, F)).astype(dtype)
    w_o = (0.1 * jax.random.normal(k[2], (F, 64))).astype(dtype)
    w_gu = (0.1 * jax.random.normal(k[3], (2 * I, F))).astype(dtype)
    w_d = (0.1 * jax.random.normal(k[4], (F, I))).astype(dtype)
    nw = (1 + 0.1 * jax.random.normal(k[5], (F,))).astype(dtype)
    # a model of these shapes hands the norm over with the kernels planned, and at one row only
    cfg = dataclasses.replace(TINY, hidden_size=F, intermediate_size=I, num_heads=2, head_dim=32)
    plan = plan_kernels(cfg, linear_impl="interpret", backend="cpu")
    assert plan.norm_handoff and not plan_kernels(cfg, linear_impl="reference", backend="cpu").norm_handoff
    assert (cfg.hidden_size, cfg.q_size) == w_o.shape and not ops.linear_kernel(plan, 2, w_o.shape, fused=True)
    # mma: both kernels on the tensor-core stream (by default these narrow weights take the
    # elementwise one)
    o_blocks, d_blocks = ((32, 64, 4, 4, True), (32, 128, 4, 4, True)) if mma else (None, None)
    h, hn, ss = fused_linear(a, w_o, residual=res, next_norm_w=nw, interpret=True, blocks=o_blocks)
    h_ref, hn_ref, ss_ref = ref_fused_linear(a, w_o, residual=res, next_norm_w=nw)
    np.testing.assert_array_equal(f32(h), f32(fused_linear(a, w_o, residual=res, interpret=True, blocks=o_blocks)))
    assert rel(h, h_ref) < (1e-2 if dtype == BF16 else 1e-5)
    np.testing.assert_array_equal(f32(hn), f32((h.astype(jnp.float32) * nw.astype(jnp.float32)).astype(dtype)))
    assert ss.shape[-1] == F // (o_blocks or one_row_blocks(F, 64, dtype))[0]  # one per program
    np.testing.assert_allclose(float(ss.sum()), float(jnp.sum(h.astype(jnp.float32) ** 2)), rtol=1e-5)
    assert ss_ref.shape == (1, 1, 1)

    gu = jnp.einsum("...d,fd->...f", hn, w_gu)
    out = fused_linear(gu, w_d, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5, interpret=True, blocks=d_blocks)
    out_ref = ref_fused_linear(gu, w_d, prologue="silu_mul", residual=h, sumsq=ss, eps=1e-5)
    assert rel(out, out_ref) < (2e-2 if dtype == BF16 else 1e-5)

    hf = h.astype(jnp.float32)  # the MLP delta in float32 from the same h
    g, u = jnp.split(rms_norm(hf, nw.astype(jnp.float32), 1e-5) @ w_gu.astype(jnp.float32).T, 2, axis=-1)
    delta = (jax.nn.silu(g) * u) @ w_d.astype(jnp.float32).T
    unfused = ref_fused_linear(ref_fused_linear(h, w_gu, prologue="rmsnorm", norm_w=nw, eps=1e-5), w_d,
                               prologue="silu_mul", residual=h)
    err = lambda o: float(jnp.linalg.norm(o.astype(jnp.float32) - hf - delta) / jnp.linalg.norm(delta))  # noqa: E731
    assert err(out) < max(2 * err(unfused), 1e-5), (err(out), err(unfused))
    with pytest.raises(ValueError, match="sumsq .* goes with the silu_mul or no prologue"):
        fused_linear(a, w_o, prologue="rmsnorm", norm_w=jnp.ones((64,), dtype), residual=res, sumsq=ss)
    with pytest.raises(ValueError, match="the one-row kernel takes a handed-over sumsq with the silu_mul prologue"):
        fused_linear(a, w_o, residual=res, sumsq=ss, interpret=True)
    with pytest.raises(ValueError, match="next_norm_w must have shape"):
        fused_linear(a, w_o, residual=res, next_norm_w=nw[:8])


@pytest.mark.parametrize("mma", [False, True])
def test_stream_rows_takes_row_slices_of_a_whole_weight(mma):
    """(ref, pl.ds(row0, n)) streams those rows of the whole weight, row0 traced (a kernel
    whose programs pick their rows at run time: the ticket-chained MLP experiment in git
    history, commit 7d2cdd6)."""
    from jax.experimental import pallas as pl
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 256)).astype(BF16)
    w = (0.1 * jax.random.normal(jax.random.PRNGKey(1), (64, 256))).astype(BF16)

    def kernel(x_ref, w_ref, o_ref):
        r0 = pl.multiple_of(pl.program_id(0) * 16, 16)
        (y,) = stream_rows(x_ref, [(w_ref, pl.ds(r0, 16))], None, prologue="none", K=256, block_d=128, eps=0.0,
                           mma=mma)
        o_ref[0, pl.ds(r0, 16)] = y

    got = pl.pallas_call(kernel, grid=(4,), in_specs=[pl.BlockSpec(), pl.BlockSpec()], out_specs=pl.BlockSpec(),
                         out_shape=jax.ShapeDtypeStruct((1, 64), jnp.float32), interpret=True)(x, w)
    want = jnp.einsum("md,fd->mf", x, w, preferred_element_type=jnp.float32)
    assert rel(got, want) < 1e-5


def test_fused_linear_routing_and_errors():
    x, w, kw = linear_inputs(5, 64, 128, "rmsnorm", BF16)
    # bf16 / f16 weights of 8B widths stream through the MMA form; narrower ones, and f32 (TF32
    # dots), through the elementwise one
    assert default_mma_blocks(64, 128, BF16) is None
    assert default_mma_blocks(6144, 4096, jnp.float16) == (64, 256, 4, 4, True)
    assert default_mma_blocks(4096, 14336, BF16) == (32, 512, 4, 6, True)
    assert default_mma_blocks(64, 128, jnp.float32) is None and default_mma_blocks(8, 128, BF16) is None
    assert ops.linear_kernel(INTERPRET, 1, w.shape, fused=True)
    assert ops.linear_kernel(KernelPlan(linear=GPU()), 1, w.shape, fused=True)
    assert not ops.linear_kernel(KernelPlan(), 1, w.shape, fused=True)
    assert not ops.linear_kernel(KernelPlan(linear=TPU()), 1, w.shape, fused=True)
    assert not ops.linear_kernel(INTERPRET, 2, w.shape, fused=True)  # > 1 row: XLA
    assert not ops.linear_kernel(INTERPRET, 1, w.shape, fused=False)  # nothing to fuse: XLA's GEMV
    assert not ops.linear_kernel(INTERPRET, 1, (20000, 128), fused=True)  # too wide
    assert not ops.linear_kernel(INTERPRET, 1, (64, 100), fused=True)  # no tile divides 100
    # a shape the kernel does not take still computes in the model, through the reference;
    # the kernel entry itself refuses it
    x2, w2, nw2 = jnp.ones((1, 100), BF16), jnp.ones((64, 100), BF16), jnp.ones((100,), BF16)
    np.testing.assert_array_equal(f32(ops.linear(INTERPRET, ops.Normed(x2, nw2, 1e-6), w2)),
                                  f32(ref_fused_linear(x2, w2, prologue="rmsnorm", norm_w=nw2)))
    with pytest.raises(ValueError, match="the kernel takes one row and a weight its tiles divide"):
        fused_linear(x2, w2, prologue="rmsnorm", norm_w=nw2, interpret=True)
    with pytest.raises(ValueError, match="prologue must be one of"):
        fused_linear(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="x has 128 features.*needs 256"):
        fused_linear(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match="rmsnorm prologue needs norm_w of shape \\(128,\\)"):
        fused_linear(x, w, prologue="rmsnorm")
    with pytest.raises(ValueError, match="residual must have shape \\(1, 1, 64\\)"):
        fused_linear(x, w, residual=jnp.zeros((1, 64), BF16))


def rope_case(seed, H, KVH, D, dtype, qk_norm):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    M, P, S = 6, 5, 4
    qkv = jax.random.normal(k[0], (M, (H + 2 * KVH) * D)).astype(dtype)
    kp = jax.random.normal(k[1], (P, S, KVH, D)).astype(dtype)
    vp = jax.random.normal(k[2], (P, S, KVH, D)).astype(dtype)
    pos = jnp.array([0, 7, 100, 5000, 3, 131000], jnp.int32)
    slot = jnp.array([1, 5, P * S, 9, 19, P * S], jnp.int32)  # P * S: padding, not written
    norms = [(1 + 0.1 * jax.random.normal(k[3 + i], (D,))).astype(dtype) for i in range(2)] if qk_norm else [None, None]
    return qkv, pos, slot, kp, vp, norms


def old_rope(x, positions, inv_freq):
    """The model's RoPE before the fused path (full-width tables, concatenated rotate-half):
    an independent formulation the shared rope_halves must match bit for bit."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * jnp.cos(emb) + rot.astype(jnp.float32) * jnp.sin(emb)).astype(x.dtype)


@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
@pytest.mark.parametrize("H,KVH,D,qk_norm", [(4, 2, 32, False), (6, 2, 64, True), (8, 8, 16, False),
                                             (0, 2, 64, True)])  # H = 0: k and v only (DFlash's context)
def test_rope_kv_write_kernel_matches_model_ops(H, KVH, D, qk_norm, dtype):
    qkv, pos, slot, kp, vp, (qn, kn) = rope_case(H + D, H, KVH, D, dtype, qk_norm)
    inv = rope_inv_freq(RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), D)
    # what the model did before the fused path: split, qk-norm, RoPE, write_kv
    M = qkv.shape[0]
    q = qkv[:, : H * D].reshape(1, M, H, D)
    k = qkv[:, H * D: (H + KVH) * D].reshape(1, M, KVH, D)
    v = qkv[:, (H + KVH) * D:].reshape(1, M, KVH, D)
    if qk_norm:
        q, k = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
    q_in = q
    q, k = old_rope(q, pos[None], inv), old_rope(k, pos[None], inv)
    np.testing.assert_array_equal(f32(apply_rope(q_in, pos[None], inv)), f32(old_rope(q_in, pos[None], inv)))
    k_want, v_want = write_kv(kp, vp, k, v, slot[None])
    cos, sin = rope_tables(pos, inv)
    ref = ref_rope_kv_write(qkv, cos, sin, slot, kp, vp, qn, kn, num_heads=H, eps=1e-6)
    for got, want in zip(ref, (q[0], k_want, v_want)):
        np.testing.assert_array_equal(f32(got), f32(want))  # the reference is the old ops, bit for bit
    ker = rope_kv_write(qkv, cos, sin, slot, kp, vp, qn, kn, num_heads=H, eps=1e-6, interpret=True)
    tol = 0 if dtype == BF16 else 2e-6  # f32: FMA contraction may differ in the last bit
    for got, want in zip(ker, ref):
        assert got.shape == want.shape and (got.size == 0 or rel(got, want) <= tol)
    # untouched cache rows (other slots, and the padding tokens' targets) keep their values
    written = {int(s) for s in slot if s < 5 * 4}
    keep = np.array([i not in written for i in range(5 * 4)])
    np.testing.assert_array_equal(f32(ker[1]).reshape(20, -1)[keep], f32(kp).reshape(20, -1)[keep])


def test_rope_kv_write_errors():
    qkv, pos, slot, kp, vp, _ = rope_case(0, 4, 2, 32, BF16, False)
    cos, sin = rope_tables(pos, np.ones(16, np.float32))
    with pytest.raises(ValueError, match="qkv must be \\[tokens, \\(heads \\+ 2 kv_heads\\) \\* head_dim\\]"):
        rope_kv_write(qkv, cos, sin, slot, kp, vp, num_heads=5)
    kp3 = jnp.zeros(kp.shape[:2] + (3,) + kp.shape[3:], kp.dtype)  # 4 query heads over 3 kv heads
    qkv3 = jnp.zeros((qkv.shape[0], (4 + 2 * 3) * 32), qkv.dtype)
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of the 3 kv heads"):
        rope_kv_write(qkv3, cos, sin, slot, kp3, kp3, num_heads=4)
    with pytest.raises(ValueError, match="rope tables must be \\[6, 16\\]"):
        rope_kv_write(qkv, cos[:, :8], sin, slot, kp, vp, num_heads=4)
    with pytest.raises(ValueError, match="q_norm_w and k_norm_w go together"):
        rope_kv_write(qkv, cos, sin, slot, kp, vp, jnp.ones(32, BF16), num_heads=4)


TINY = ModelConfig(
    family="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope=RopeConfig(1000000.0), tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, qk_norm=True, max_position_embeddings=4096,
)


def decoder_case(cfg, Q: int, seed: int):
    """(a random bf16 cache of 8 pages of 16, one sequence's metadata writing Q tokens at 40 - Q..,
    its Q tokens, random bf16 parameters) for a decoder of ``cfg``."""
    P, S = 8, 16
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * cfg.num_layers)
    shape = (P, S, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache(k=tuple(jax.random.normal(keys[i], shape).astype(BF16) for i in range(cfg.num_layers)),
                 v=tuple(jax.random.normal(keys[-1 - i], shape).astype(BF16) for i in range(cfg.num_layers)))
    meta = AttentionMetadata.for_single_sequence([3, 1, 5], S, 41 - Q, Q, P)
    tok = jnp.array([[17, 3, 250, 9][-Q:]], jnp.int32)
    params = Transformer(cfg, dtype=BF16).init(jax.random.PRNGKey(0), tok, meta, kv)["params"]
    params = jax.tree.map(lambda a: (a + 0.05 * jax.random.normal(jax.random.PRNGKey(a.size), a.shape)).astype(BF16),
                          params)
    return kv, meta, tok, params


@pytest.mark.parametrize("qk_norm,bias,Q", [(True, False, 1), (False, True, 1), (True, False, 4), (False, False, 4),
                                            (False, True, 4)])
def test_decoder_with_fused_kernels_matches_reference(qk_norm, bias, Q):
    """A batch-1 decode step (Q = 1) or verification step (Q = 4 rows: fused_linear_rows,
    with both norms handed over) with linear_impl="interpret" (fused projections, RoPE + KV
    write kernels) == the reference model: hidden states, logits and the written KV. With
    biases (attention and MLP) the post-attention norm is not handed over: down_proj's 1 / rms
    would scale gate_up's bias too."""
    cfg = dataclasses.replace(TINY, qk_norm=qk_norm, attention_bias=bias, mlp_bias=bias)
    P, S = 8, 16
    kv, meta, tok, params = decoder_case(cfg, Q, 3)
    outs = {}
    plans = {impl: plan_kernels(cfg, attn_impl="reference", linear_impl=impl, backend="cpu")
             for impl in ("reference", "interpret")}
    for impl, plan in plans.items():
        m, p = Transformer(cfg, dtype=BF16, plan=plan), plan_params(plan, params)  # CPU reference: [in, out]
        h, _, kv2 = m.apply({"params": p}, tok, meta, kv)
        outs[impl] = (h, m.apply({"params": p}, h, method=Transformer.logits), kv2)
    (h0, l0, kv0), (h1, l1, kv1) = outs["reference"], outs["interpret"]
    # the interpret model hands the post-attention norm over (o_proj -> down_proj kernels)
    assert plans["interpret"].norm_handoff == (not bias)
    assert rel(h1, h0) < 3e-2 and rel(l1, l0) < 3e-2
    for a, b in zip(kv0.k + kv0.v, kv1.k + kv1.v):
        assert rel(b, a) < 3e-2
    # The layer-0 KV write depends only on the first norm + qkv projection + RoPE.
    slot = 5 * S + 40 % S
    np.testing.assert_allclose(f32(kv1.k[0]).reshape(P * S, -1)[slot], f32(kv0.k[0]).reshape(P * S, -1)[slot],
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,bias,drop,blocks,K", [
    (BF16, False, False, (16, 128, 4, 4, True), 256), (BF16, True, True, None, 256), (jnp.float32, True, False, None, 256),
    # K = 320 in chunks of 128: a masked last chunk (gpt-oss's K = 2880 in 512s), both streams
    (BF16, True, False, (16, 128, 4, 4, True), 320), (jnp.float32, False, False, (4, 128, 4, 4, False), 320)])
def test_qkv_rope_kv_write_kernel_is_the_two_kernels_composed(dtype, bias, drop, blocks, K):
    """The one-kernel batch-1 attention input (norm + qkv + RoPE + KV write) == the
    projection kernel followed by the RoPE + KV-write kernel, bit for bit (same arithmetic
    per row), and == the XLA reference within the dtype's tolerance; a padding slot
    writes nothing. blocks: the tiles (mma: the tensor-core stream, which by default only 8B
    widths take), None: the default's."""
    H, KVH, D, P, S = 4, 2, 32, 6, 8
    ks = jax.random.split(jax.random.PRNGKey(8), 8)
    x = (2 * jax.random.normal(ks[0], (1, K))).astype(dtype)
    w = (0.05 * jax.random.normal(ks[1], ((H + 2 * KVH) * D, K))).astype(dtype)
    nw = (1 + 0.1 * jax.random.normal(ks[2], (K,))).astype(dtype)
    b = (0.1 * jax.random.normal(ks[3], (w.shape[0],))).astype(dtype) if bias else None
    kp = jax.random.normal(ks[4], (P, S, KVH, D)).astype(dtype)
    vp = jax.random.normal(ks[5], (P, S, KVH, D)).astype(dtype)
    cos, sin = rope_tables(jnp.array([29]), rope_inv_freq(RopeConfig(10000.0), D))
    slot = jnp.array([P * S if drop else 19], jnp.int32)
    args = (x, w, nw, b, cos, sin, slot, kp, vp)
    if blocks is not None:
        q1, k1, v1 = qkv_rope_kv_write_gpu(*args, num_heads=H, eps=1e-5, blocks=blocks, interpret=True)
    else:
        blocks = qkv_kernel_blocks(w.shape[0], K, D, dtype)
        assert not blocks[-1]  # these narrow weights take the elementwise stream
        q1, k1, v1 = qkv_rope_kv_write(*args, num_heads=H, eps=1e-5, interpret=True)
    # the projection kernel with the same tile per weight, hence the same summation order per row
    pairs, bd, warps, stages, mma = blocks
    qkv = fused_linear_gpu(x, w, nw, b, prologue="rmsnorm", eps=1e-5, blocks=(pairs, bd, warps, stages, mma),
                           interpret=True)
    q2, k2, v2 = rope_kv_write(qkv, cos, sin, slot, kp, vp, num_heads=H, eps=1e-5, interpret=True)
    for a, c in ((q1, q2), (k1, k2), (v1, v2)):
        if K % bd and dtype == jnp.float32:  # the masked chunk: XLA on the CPU may contract a*b+c into
            np.testing.assert_allclose(f32(a), f32(c), rtol=1e-6, atol=1e-6)  # an FMA in one kernel only
        else:
            np.testing.assert_array_equal(f32(a), f32(c))
    q3, k3, v3 = ref_qkv_rope_kv_write(*args, num_heads=H, eps=1e-5)
    tol = 1e-2 if dtype == BF16 else 1e-5
    assert rel(q1, q3) < tol and rel(k1, k3) < tol and rel(v1, v3) < tol
    written = (k1 != kp).any(axis=(2, 3)).reshape(-1)
    assert int(written.sum()) == (0 if drop else 1) and (drop or bool(written[19]))
    assert bool((v1 != vp).any()) != drop


def test_qkv_rope_kv_write_routing_and_errors():
    x, w = jnp.zeros((1, 256), BF16), jnp.zeros((256, 256), BF16)
    kp = jnp.zeros((4, 8, 2, 32), BF16)
    assert ops.qkv_kernel(KernelPlan(linear=GPU()), 1, w.shape, 32, BF16)
    assert ops.qkv_kernel(INTERPRET, 1, w.shape, 32, BF16)
    assert not ops.qkv_kernel(KernelPlan(), 1, w.shape, 32, BF16)
    assert not ops.qkv_kernel(KernelPlan(linear=GPU()), 2, w.shape, 32, BF16)
    with pytest.raises(ValueError, match="the kernel takes one token"):
        qkv_rope_kv_write(jnp.zeros((2, 256), BF16), w, jnp.ones(256, BF16), None, jnp.zeros((2, 16)),
                          jnp.zeros((2, 16)), jnp.zeros(2, jnp.int32), kp, kp, num_heads=4, eps=1e-5)
    cos = jnp.zeros((1, 16))
    with pytest.raises(ValueError, match=r"qkv weight must be \[\(heads \+ 2 kv_heads\) \* head_dim, in\] = \[192"):
        qkv_rope_kv_write(x, w, jnp.ones(256, BF16), None, cos, cos, jnp.zeros(1, jnp.int32), kp, kp, num_heads=2,
                          eps=1e-5)
    with pytest.raises(ValueError, match=r"norm_w must be \[256\]"):
        qkv_rope_kv_write(x, w, jnp.ones(128, BF16), None, cos, cos, jnp.zeros(1, jnp.int32), kp, kp, num_heads=4,
                          eps=1e-5)
