"""The MoE router kernels (kernels_pallas/moe_router.py, Pallas interpret mode) == their jnp
references (jax.nn.softmax, then jax.lax.top_k; rms_norm, then a Linear), and ops.moe reaches
them with the GPU plan.
The whole MoE layer against transformers: tests/models/test_moe_op.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from kernels_pallas.moe_router import (
    norm_logits,
    norm_logits_supports,
    ref_norm_logits,
    ref_router_top_k,
    router_top_k,
    supports,
)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("N,E,top_k", [(1, 128, 8), (5, 60, 4), (3, 8, 8), (2, 16, 1)])
def test_kernel_matches_reference(N, E, top_k, norm):
    """Power-of-two and padded rows (60 experts: 4 pads), top_k up to every expert."""
    logits = 3 * jax.random.normal(jax.random.PRNGKey(N * E + top_k), (N, E))
    w, e = router_top_k(logits, top_k=top_k, norm=norm, interpret=True)
    w_ref, e_ref = ref_router_top_k(logits, top_k=top_k, norm=norm)
    assert w.shape == e.shape == (N, top_k) and w.dtype == jnp.float32 and e.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)


def test_ties_take_the_lower_expert_and_pads_are_never_chosen():
    """lax.top_k's order on equal probabilities (lower index first); a row of 6 equal logits
    padded to 8 with -inf chooses all 6 experts before any pad."""
    logits = jnp.array([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0], [0.5] * 6])
    w, e = router_top_k(logits, top_k=6, norm=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(e), [[1, 2, 4, 0, 5, 3], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(np.asarray(e), np.asarray(ref_router_top_k(logits, top_k=6, norm=False)[1]))
    np.testing.assert_allclose(np.asarray(w[1]), 1 / 6, rtol=1e-6)


def test_ops_moe_reaches_the_router_kernel_with_the_gpu_plan():
    """With the plan's GPU kernels ops.moe chooses its experts in the kernel at any number of
    tokens; the reference plan through XLA; the two layers agree."""
    E, I, H = 8, 32, 64
    k = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(k[0], (1, 3, H))
    router = 0.5 * jax.random.normal(k[1], (E, H))
    gu, dn = 0.2 * jax.random.normal(k[2], (E, 2 * I, H)), 0.2 * jax.random.normal(k[3], (E, H, I))
    kw = dict(top_k=2, norm_topk_prob=True)

    def names(plan, a):
        return str(jax.make_jaxpr(lambda a: ops.moe(plan, a, router, gu, dn, **kw))(a))

    gpu = ops.KernelPlan(linear=ops.GPU(interpret=True))
    assert "moe_router_top2" in names(gpu, x) and "moe_router_top2" in names(gpu, x[:, :1])
    assert "moe_router" not in names(ops.KernelPlan(), x)
    np.testing.assert_allclose(np.asarray(ops.moe(gpu, x, router, gu, dn, **kw)),
                               np.asarray(ops.moe(ops.KernelPlan(), x, router, gu, dn, **kw)), rtol=1e-5, atol=1e-5)


def test_supports_and_errors():
    assert supports(128, 8) and supports(8, 8) and not supports(8, 9) and not supports(8192, 8)
    logits = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="top_k=9"):
        router_top_k(logits, top_k=9, norm=True, interpret=True)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        router_top_k(logits[0], top_k=2, norm=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("N,E,H,bias", [(1, 32, 2880, True), (3, 60, 96, False), (2, 5, 40, True)])
def test_norm_logits_kernel_matches_reference(N, E, H, bias, dtype):
    """The norm and the router's projection in one kernel == rms_norm then a Linear: gpt-oss's
    width (2880: padded to 4096, masked), a width padded within a program's rows (96 -> 128:
    experts in blocks, 60 a partial last one), a narrow one (5 experts, 40 wide); the normed
    rows bit for bit in bf16 and the logits to the f32 sums' order (one bf16 rounding)."""
    k = jax.random.split(jax.random.PRNGKey(N * E + H), 4)
    x = (3 * jax.random.normal(k[0], (N, H))).astype(dtype)
    w = (0.05 * jax.random.normal(k[1], (E, H))).astype(dtype)
    nw = (1 + 0.1 * jax.random.normal(k[2], (H,))).astype(dtype)
    b = (0.1 * jax.random.normal(k[3], (E,))).astype(dtype) if bias else None
    xn, logits = norm_logits(x, w, norm_w=nw, eps=1e-5, bias=b, interpret=True)
    xn_ref, logits_ref = ref_norm_logits(x, w, norm_w=nw, eps=1e-5, bias=b)
    assert xn.shape == (N, H) and xn.dtype == dtype and logits.shape == (N, E) and logits.dtype == jnp.float32
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    tol = 1e-6 if dtype == jnp.float32 else 0.0
    np.testing.assert_allclose(f32(xn), f32(xn_ref), rtol=tol, atol=tol)
    ulp = 2e-6 if dtype == jnp.float32 else 2 ** -7  # a rounding apart at most
    np.testing.assert_allclose(f32(logits), f32(logits_ref), rtol=ulp, atol=ulp)
    assert norm_logits_supports(16, 2880) and not norm_logits_supports(17, 2880) and not norm_logits_supports(1, 16384)
    with pytest.raises(ValueError, match="norm weight"):
        norm_logits(x, w, norm_w=nw[:-1], eps=1e-5)
