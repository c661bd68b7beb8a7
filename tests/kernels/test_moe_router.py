"""The MoE router kernel (kernels_pallas/moe_router.py, Pallas interpret mode) == its jnp
reference (jax.nn.softmax, then jax.lax.top_k), and ops.moe reaches it with the GPU plan.
The whole MoE layer against transformers: tests/models/test_moe_op.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from kernels_pallas.moe_router import ref_router_top_k, router_top_k, supports


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
