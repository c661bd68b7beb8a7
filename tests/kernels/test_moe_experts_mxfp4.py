"""The MXFP4 expert kernels (kernels_pallas/moe_experts_mxfp4.py) == their jnp reference on
CPU (Pallas interpret mode), with gpt-oss's biases and clamped SwiGLU and without; the
reference's dequantization == the checkpoint reader's; ops.moe on packed experts with the GPU
plan == on XLA. gpt-oss end to end against transformers: tests/e2e/test_gpt_oss.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from jspec.kernel_backend import GPU
from jspec.kernel_plan import KernelPlan
from jspec.mxfp4 import Mxfp4Weight
from kernels_pallas.moe_experts import combine_pairs, ref_moe_experts
from kernels_pallas.moe_experts_mxfp4 import (
    dequantize,
    fp4_as_f16,
    fp4_values,
    moe_experts_mxfp4,
    moe_experts_mxfp4_gpu,
    ref_moe_experts_mxfp4,
    supports,
    use_mma,
)
from tests.helpers.mxfp4 import packed

BF16 = jnp.bfloat16
# H = 96: G = 3 blocks of 32, so a block_g of 2 leaves a masked last step (gpt-oss's G = 90);
# I = 64 (GI = 2).
E, I, H = 6, 64, 96


def inputs(seed, N, top_k, dtype, bias):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, H)), dtype)
    gu, dn = packed(rng, E, 2 * I, H), packed(rng, E, H, I)
    experts = rng.permutation(E)[: N * top_k] if N * top_k <= E else rng.integers(0, E, N * top_k)
    b = dict(b_gate_up=jnp.asarray(rng.normal(size=(E, 2 * I)) * 0.1, dtype),
             b_down=jnp.asarray(rng.normal(size=(E, H)) * 0.1, dtype)) if bias else {}
    return x, jnp.asarray(experts, jnp.int32), gu, dn, b


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def test_dequantize_is_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = packed(np.random.default_rng(0), 3, 8, 96)
    ref = convert_moe_packed_tensors(torch.from_numpy(np.asarray(blocks)), torch.from_numpy(np.asarray(scales)),
                                     dtype=torch.float32)
    np.testing.assert_array_equal(f32(dequantize(blocks, scales, jnp.float32)), ref.transpose(1, 2).numpy())


def test_the_kernels_decode_is_the_references_for_every_byte():
    """fp4_as_f16 (the kernels': bits moved into a float16) times 2^14 == fp4_values (the
    reference's arithmetic) == the OCP table, both nibbles of all 256 bytes."""
    b = jnp.arange(256, dtype=jnp.int32)
    lo, hi = fp4_as_f16(b)
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    for got, codes in ((lo, b & 15), (hi, b >> 4)):
        np.testing.assert_array_equal(f32(got) * 2.0**14, f32(fp4_values(codes)))
        np.testing.assert_array_equal(f32(fp4_values(codes)), table[np.asarray(codes)])


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("N,top_k,oss", [(2, 3, True), (3, 2, False), (1, 4, True)])
def test_kernel_matches_reference(N, top_k, oss, dtype):
    x, experts, gu, dn, b = inputs(N * 10 + top_k, N, top_k, dtype, oss)
    act = dict(limit=7.0, alpha=1.702) if oss else {}
    got = moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, interpret=True, **b, **act)
    want = ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, **b, **act)
    assert got.shape == want.shape == (N * top_k, H) and got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # f32: summation order; bf16: a rounding or two apart
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol * float(np.abs(f32(want)).max()))


@pytest.mark.parametrize("N,top_k,oss", [(2, 3, True), (4, 2, False)])
def test_tensor_core_path_matches_reference(N, top_k, oss):
    """The tensor-core path (codes decoded to float16, one dot a step against the block-diagonal
    activations, each block's sum scaled apart) == the reference, bf16, at the default tile and
    at tiles with a masked last step (G = 3) and one block a step."""
    x, experts, gu, dn, b = inputs(N * 10 + top_k + 1, N, top_k, BF16, oss)
    act = dict(limit=7.0, alpha=1.702) if oss else {}
    want = ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, **b, **act)
    b = b or dict(b_gate_up=jnp.zeros((E, 2 * I), BF16), b_down=jnp.zeros((E, H), BF16))
    for blocks in (None, (16, 2, 4, 1), (32, 1, 4, 1)):
        got = moe_experts_mxfp4_gpu(x, experts, *gu, *dn, b["b_gate_up"], b["b_down"], top_k=top_k, blocks=blocks,
                                    mma=True, interpret=True, **act)
        assert got.shape == want.shape and got.dtype == BF16
        np.testing.assert_allclose(f32(got), f32(want), rtol=2e-2, atol=2e-2 * float(np.abs(f32(want)).max()),
                                   err_msg=str(blocks))


def test_tensor_core_path_is_taken_from_its_pair_count_on_bf16():
    assert use_mma(8, 2880, 2880, BF16) and not use_mma(4, 2880, 2880, BF16)
    assert not use_mma(64, 2880, 2880, jnp.float32)  # float32 activations would lose bits in the float16 dot
    assert not use_mma(64, 8, 8, BF16)  # no 16-row tile divides I = 8


def test_reference_is_the_dense_mlp_on_dequantized_weights():
    """ref_moe_experts_mxfp4 (gather packed, then dequantize) == ref_moe_experts on every
    expert dequantized first, the way ops.moe's dense pass reads them."""
    x, experts, gu, dn, b = inputs(1, 2, 2, jnp.float32, True)
    want = ref_moe_experts(x, experts, dequantize(*gu, jnp.float32), dequantize(*dn, jnp.float32), top_k=2,
                           limit=7.0, **b)
    got = ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=2, limit=7.0, **b)
    np.testing.assert_allclose(f32(got), f32(want), rtol=1e-6, atol=1e-6)


def test_tiles_and_masked_steps():
    """Explicit tiles: rows 8 at a time, one block of 32 a step (no mask) and four (G = 3:
    one masked step): all equal the reference."""
    x, experts, gu, dn, b = inputs(2, 2, 2, jnp.float32, True)
    want = ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=2, limit=7.0, **b)
    for blocks in ((8, 1, 4, 1), (8, 4, 4, 1), (16, 2, 4, 1)):
        got = moe_experts_mxfp4_gpu(x, experts, *gu, *dn, b["b_gate_up"], b["b_down"], top_k=2, limit=7.0,
                                    blocks=blocks, interpret=True)
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-5, atol=1e-5, err_msg=str(blocks))


def test_contract():
    assert supports((1, 2880), (32, 5760, 90, 16))  # gpt-oss-20b
    assert supports((1, 2880), (128, 5760, 90, 16))  # gpt-oss-120b
    assert not supports((1, 2880), (4, 6, 90, 16))  # I = 3: no tile
    x, experts, gu, dn, _ = inputs(0, 1, 2, jnp.float32, False)
    with pytest.raises(ValueError, match="uint8"):
        moe_experts_mxfp4(x, experts, gu[0].astype(jnp.int32), gu[1], *dn, top_k=2)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts_mxfp4(x[:, :64], experts, *gu, *dn, top_k=2)


@pytest.mark.parametrize("N", [2, 5])
def test_ops_moe_gpu_plan_streams_packed_experts_as_xla_does(N):
    """ops.moe on Mxfp4Weight experts: the GPU plan (the kernels, interpreted) == the XLA plan:
    4 pairs (<= E: XLA gathers packed, then dequantizes) and 10 (> E: XLA's dense way, every
    expert dequantized; the kernels up to MXFP4_KERNEL_MAX_FRACTION * E)."""
    x, _, gu, dn, b = inputs(4, N, 2, BF16, True)
    rng = np.random.default_rng(4)
    w_router = jnp.asarray(rng.normal(size=(E, H)), BF16)
    args = dict(top_k=2, norm_topk_prob=True, b_router=jnp.zeros((E,), BF16), swiglu_limit=7.0, **b)
    wg, wd = Mxfp4Weight(*gu, "bfloat16"), Mxfp4Weight(*dn, "bfloat16")
    calls = []
    import kernels_pallas.moe_experts_mxfp4 as k

    real = k.moe_experts_mxfp4_gpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(k, "moe_experts_mxfp4_gpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = ops.moe(KernelPlan(linear=GPU(interpret=True)), x, w_router, wg, wd, **args)
    want = ops.moe(KernelPlan(), x, w_router, wg, wd, **args)
    assert calls, "the GPU plan did not take the MXFP4 kernels"
    np.testing.assert_allclose(f32(got), f32(want), rtol=2e-2, atol=2e-2 * float(np.abs(f32(want)).max()))


@pytest.mark.parametrize("N", [1, 3, 4])
def test_ops_moe_routes_a_normed_input_in_one_kernel_and_sums_pairs_in_down(N):
    """A few tokens of an un-applied norm (ops.Normed, as the decoder layer hands it over) on
    MXFP4 experts with the GPU plan: the norm and the router's projection in one kernel
    (moe_router_logits), the top-k in router_top_k's, each token's weighted sum and the residual
    in down's (moe_mxfp4_down_sum), no XLA dot; == the XLA plan's layer (the norm, router
    Linear, top-k, experts, combine_pairs, residual as ops). At the tensor-core stream's pair
    counts (4 tokens: 8 pairs) the XLA router and the pairs apart, as before."""
    x, _, gu, dn, b = inputs(7 + N, N, 2, BF16, True)
    rng = np.random.default_rng(N)
    w_router = jnp.asarray(rng.normal(size=(E, H)) * 0.3, BF16)
    normed = ops.Normed(x[None], jnp.asarray(1 + 0.1 * rng.normal(size=H), BF16), 1e-5)
    res = jnp.asarray(rng.normal(size=(1, N, H)), BF16)
    args = dict(top_k=2, norm_topk_prob=True, b_router=jnp.asarray(rng.normal(size=E) * 0.1, BF16),
                swiglu_limit=7.0, residual=res, **b)
    wg, wd = Mxfp4Weight(*gu, "bfloat16"), Mxfp4Weight(*dn, "bfloat16")
    gpu = KernelPlan(linear=GPU(interpret=True))
    jaxpr = str(jax.make_jaxpr(lambda n: ops.moe(gpu, n, w_router, wg, wd, **args))(normed))
    fused = not use_mma(2 * N, I, H, BF16)
    assert fused == (N < 4)
    for name in ("moe_router_logits", "moe_mxfp4_down_sum"):
        assert (name in jaxpr) == fused, name
    assert "moe_router_top2" in jaxpr and "moe_mxfp4_gate_up" in jaxpr and ("dot_general" in jaxpr) != fused
    got = ops.moe(gpu, normed, w_router, wg, wd, **args)
    want = ops.moe(KernelPlan(), normed, w_router, wg, wd, **args)
    assert got.shape == want.shape == (1, N, H) and got.dtype == BF16
    np.testing.assert_allclose(f32(got), f32(want), rtol=2e-2, atol=2e-2 * float(np.abs(f32(want)).max()))


def test_summed_down_matches_combine_pairs():
    """weights (and a residual): down's programs sum each token's pairs in its epilogue ==
    the reference's per-pair rows through moe_experts.combine_pairs; without the residual too.
    The summed form streams on CUDA cores: asking it of the tensor-core path is an error."""
    N, top_k = 3, 2
    x, experts, gu, dn, b = inputs(31, N, top_k, BF16, True)
    rng = np.random.default_rng(31)
    wts, res = jnp.asarray(rng.random((N, top_k)), BF16), jnp.asarray(rng.normal(size=(N, H)), BF16)
    act = dict(limit=7.0, alpha=1.702)
    for residual in (res, None):
        want = ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, weights=wts, residual=residual, **b, **act)
        np.testing.assert_array_equal(f32(want), f32(combine_pairs(
            ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, **b, **act), wts, residual=residual)))
        got = moe_experts_mxfp4_gpu(x, experts, *gu, *dn, b["b_gate_up"], b["b_down"], wts, residual, top_k=top_k,
                                    interpret=True, **act)
        assert got.shape == (N, H) and got.dtype == BF16
        np.testing.assert_allclose(f32(got), f32(want), rtol=2e-2, atol=2e-2 * float(np.abs(f32(want)).max()))
    with pytest.raises(ValueError, match="weights"):
        moe_experts_mxfp4(x, experts, *gu, *dn, top_k=top_k, weights=wts[:, :1])
    with pytest.raises(ValueError, match="CUDA cores"):
        moe_experts_mxfp4_gpu(x, experts, *gu, *dn, b["b_gate_up"], b["b_down"], wts, top_k=top_k, mma=True,
                              interpret=True, **act)
