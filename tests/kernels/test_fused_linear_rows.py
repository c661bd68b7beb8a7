"""fused_linear_rows (kernels_pallas/fused_linear_rows.py), the 2-16-row projection of a
verification step: kernel (Pallas interpret mode) == reference at each epilogue and row
count, the reference == the unfused norm / projection / SwiGLU maths, and the ops' routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from jspec.ops import GPU, KernelPlan
from kernels_pallas.fused_linear import ref_fused_linear, rms_norm, silu_mul
from kernels_pallas.fused_linear_rows import MAX_ROWS, fused_linear_rows, ref_fused_linear_rows, supports

BF16, F16 = jnp.bfloat16, jnp.float16
F, K = 64, 128
BLOCKS = (32, 64, 4, 2)  # two programs, two K steps


def f32(a):
    return np.asarray(a, np.float32)


def inputs(R, dtype, seed=0, F=F):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(k[0], (R, K)).astype(dtype)
    w = (0.05 * jax.random.normal(k[1], (F, K))).astype(dtype)
    b = jax.random.normal(k[2], (F,)).astype(dtype)
    res = jax.random.normal(k[3], (R, F)).astype(dtype)
    h = jax.random.normal(k[4], (R, K))  # the residual stream whose norm is handed over
    ss = jnp.stack([jnp.sum(h[:, :50] ** 2, -1), jnp.sum(h[:, 50:] ** 2, -1)], -1)  # 2 partial sums a row
    nn = (1 + 0.1 * jax.random.normal(k[5], (F,))).astype(dtype)
    return x, w, b, res, ss, nn


@pytest.mark.parametrize("R", [2, 3, 16])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("epilogue", ["bias_residual", "norm_in", "norm_in_residual_handoff"])
def test_kernel_matches_reference(R, dtype, epilogue):
    """Within one ulp of the activation dtype (the dot sums K in the kernel's chunks; same
    roundings and norm factors otherwise); rows past R (the MMA operand's zero rows)
    neither read nor written."""
    x, w, b, res, ss, nn = inputs(R, dtype)
    ulp = float(jnp.finfo(dtype).eps)
    same = lambda a, b: np.testing.assert_allclose(f32(a), f32(b), rtol=ulp, atol=ulp)  # noqa: E731
    kw = {"bias_residual": dict(bias=b, residual=res), "norm_in": dict(sumsq=ss, eps=1e-5),
          "norm_in_residual_handoff": dict(sumsq=ss, residual=res, next_norm_w=nn, eps=1e-5)}[epilogue]
    got = fused_linear_rows(x, w, interpret=True, blocks=BLOCKS, **kw)
    ref = ref_fused_linear(x, w, **kw)
    if isinstance(got, tuple):
        y, hn, part = got
        same(y, ref[0])
        same(hn, ref[1])
        assert part.shape == (R, F // BLOCKS[0])  # one partial sum per program
        np.testing.assert_allclose(f32(part).sum(-1), f32(ref[2]).sum(-1), rtol=1e-6)
    else:
        same(got, ref)


@pytest.mark.parametrize("swiglu", [False, True])
def test_masked_last_chunk(swiglu):
    """K = 160 in chunks of 64: the last chunk's columns past K masked to zeros in x and W
    (k_block's choice for gpt-oss's K = 2880); == the reference."""
    k = jax.random.split(jax.random.PRNGKey(7), 4)
    R, K2 = 5, 160
    x = jax.random.normal(k[0], (R, K2)).astype(BF16)
    w = (0.05 * jax.random.normal(k[1], (2 * F if swiglu else F, K2))).astype(BF16)
    kw = dict(swiglu=True) if swiglu else dict(bias=jax.random.normal(k[2], (F,)).astype(BF16),
                                               residual=jax.random.normal(k[3], (R, F)).astype(BF16))
    got = fused_linear_rows(x, w, interpret=True, blocks=(16 if swiglu else 32, 64, 4, 2), **kw)
    ref = ref_fused_linear_rows(x, w, **kw)
    np.testing.assert_allclose(f32(got), f32(ref), rtol=2 ** -7, atol=2 ** -7)  # one bf16 ulp


@pytest.mark.parametrize("R", [2, 5, 16])
def test_swiglu_epilogue_matches_reference(R):
    """gate_up on a handed-over norm with SwiGLU in the epilogue: each program streams its
    gate rows and the matching up rows; == silu(g) * u of the reference projection."""
    x, w, *_, ss, _ = inputs(R, BF16, seed=1, F=2 * F)
    got = fused_linear_rows(x, w, sumsq=ss, eps=1e-5, swiglu=True, interpret=True, blocks=(16, 64, 4, 2))
    ref = ref_fused_linear_rows(x, w, sumsq=ss, eps=1e-5, swiglu=True)
    assert got.shape == (R, F)
    np.testing.assert_allclose(f32(got), f32(ref), rtol=2 ** -7, atol=2 ** -7)  # one bf16 ulp


def test_reference_is_the_unfused_maths():
    """x = h * norm_w with sums of h^2 handed over: the factored norm == rms_norm(h) then the
    projection, within bf16 rounding; swiglu == silu_mul of the projection."""
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    h = jax.random.normal(k[0], (4, K)).astype(BF16)
    nw = (1 + 0.1 * jax.random.normal(k[1], (K,))).astype(BF16)
    w = (0.05 * jax.random.normal(k[2], (2 * F, K))).astype(BF16)
    hf = h.astype(jnp.float32)
    scaled = (hf * nw.astype(jnp.float32)).astype(BF16)
    ss = jnp.sum(hf * hf, -1, keepdims=True)
    y = ref_fused_linear(scaled, w, sumsq=ss, eps=1e-5)
    unfused = rms_norm(h, nw, 1e-5) @ w.T
    np.testing.assert_allclose(f32(y), f32(unfused), rtol=3e-2, atol=3e-2)
    np.testing.assert_array_equal(f32(ref_fused_linear_rows(scaled, w, sumsq=ss, eps=1e-5, swiglu=True)),
                                  f32(silu_mul(y)))


def test_contract_routing_and_errors():
    w = jnp.zeros((F, K), BF16)
    assert supports(2, w.shape, BF16) and supports(MAX_ROWS, w.shape, BF16)
    assert not supports(1, w.shape, BF16) and not supports(MAX_ROWS + 1, w.shape, BF16)
    assert not supports(4, w.shape, jnp.float32)  # an f32 dot would run in TF32
    assert supports(4, (2 * F, K), BF16, swiglu=True) and not supports(4, (F + 1, K), BF16, swiglu=True)
    # the ops: 2-16 rows of a bf16 weight with something to fuse and no prologue
    gpu = KernelPlan(linear=GPU())
    assert ops.linear_kernel(gpu, 16, w.shape, fused=True, dtype=BF16)
    assert not ops.linear_kernel(gpu, 16, w.shape, fused=True, dtype=BF16, prologue="rmsnorm")
    assert not ops.linear_kernel(gpu, 17, w.shape, fused=True, dtype=BF16)
    assert not ops.linear_kernel(gpu, 16, w.shape, fused=False, dtype=BF16)
    assert not ops.linear_kernel(gpu, 16, w.shape, fused=True, dtype=jnp.float32)
    assert not ops.linear_kernel(KernelPlan(), 16, w.shape, fused=True, dtype=BF16)
    x = jnp.zeros((3, K), BF16)
    with pytest.raises(ValueError, match="takes 2 to 16 rows and a bf16 / f16 weight"):
        fused_linear_rows(jnp.zeros((1, K), BF16), w, residual=jnp.zeros((1, F), BF16), interpret=True)
    with pytest.raises(ValueError, match="takes 2 to 16 rows and a bf16 / f16 weight"):
        fused_linear_rows(x.astype(jnp.float32), w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="swiglu takes a gate\\|up weight of even rows"):
        fused_linear_rows(x, w, residual=jnp.zeros((3, F), BF16), swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="x has 64 features"):
        fused_linear_rows(x[:, :64], w, interpret=True)
