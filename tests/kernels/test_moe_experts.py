"""The few-token MoE kernels (kernels_pallas/moe_experts.py) == their jnp reference on CPU
(Pallas interpret mode), and ops.moe with the GPU plan's kernels == ops.moe on XLA. The
reference against transformers: tests/models/test_moe_op.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from kernels_pallas.moe_experts import moe_experts, moe_experts_gpu, ref_moe_experts, supports

BF16 = jnp.bfloat16
E, I, H = 8, 96, 64  # I = 3 x 32: the down kernel steps over I in chunks of 32


def inputs(seed, N, top_k, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (N, H)).astype(dtype)
    gu = (0.2 * jax.random.normal(k[1], (E, 2 * I, H))).astype(dtype)
    dn = (0.2 * jax.random.normal(k[2], (E, H, I))).astype(dtype)
    experts = jax.random.permutation(k[3], E)[: N * top_k] if N * top_k <= E else \
        jax.random.randint(k[3], (N * top_k,), 0, E)
    return x, experts.astype(jnp.int32), gu, dn


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


# Tensor-core tiles for gate_up [I, H] and down [H, I]: by default narrow experts take the
# elementwise weight stream (kernels_pallas/tuning.py); both are checked.
MMA_TILES = ((32, 32, 4, 3, True), (32, 32, 4, 3, True))


@pytest.mark.parametrize("dtype,blocks", [(jnp.float32, None), (BF16, None), (BF16, MMA_TILES)])
@pytest.mark.parametrize("N,top_k", [(1, 2), (3, 2), (2, 4), (5, 3)])
def test_kernel_matches_reference(N, top_k, dtype, blocks):
    x, experts, gu, dn = inputs(N * 10 + top_k, N, top_k, dtype)
    if blocks:
        got = moe_experts_gpu(x, experts, gu, dn, top_k=top_k, blocks=blocks, interpret=True)
    else:
        got = moe_experts(x, experts, gu, dn, top_k=top_k, interpret=True)
    want = ref_moe_experts(x, experts, gu, dn, top_k=top_k)
    assert got.shape == want.shape == (N * top_k, H) and got.dtype == want.dtype
    # f32: summation order; bf16: each projection rounded to bf16, a bf16 ulp or two apart
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol * float(np.abs(f32(want)).max()))


def test_kernel_reads_each_pairs_own_expert():
    """Pairs of one token on different experts, and two tokens on one expert: a kernel that
    read the wrong expert's rows, or the wrong token's row, would differ from the reference."""
    x, _, gu, dn = inputs(3, 2, 2, jnp.float32)
    experts = jnp.array([5, 0, 5, 7], jnp.int32)
    got = moe_experts(x, experts, gu, dn, top_k=2, interpret=True)
    np.testing.assert_allclose(f32(got), f32(ref_moe_experts(x, experts, gu, dn, top_k=2)), rtol=1e-5, atol=1e-5)
    assert not np.allclose(f32(got[0]), f32(got[2]))  # same expert, different tokens


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_ops_moe_with_gpu_kernels_matches_xla(dtype):
    """ops.moe's few-pair way through the kernels (plan linear="interpret") == through XLA.
    2 tokens x top_k 3 = 6 pairs: between MOE_KERNEL_MIN_FRACTION * E and E, the kernels' range;
    1 token's 3 pairs stay with XLA's gather."""
    x, _, gu, dn = inputs(7, 2, 2, dtype)
    router = (0.5 * jax.random.normal(jax.random.PRNGKey(8), (E, H))).astype(dtype)
    x = x.reshape(1, 2, H)
    kw = dict(top_k=3, norm_topk_prob=True)
    gpu = ops.KernelPlan(linear=ops.GPU(interpret=True))
    kernels = lambda a: "moe_gate_up" in str(jax.make_jaxpr(lambda a: ops.moe(gpu, a, router, gu, dn, **kw))(a))  # noqa: E731
    assert kernels(x) and not kernels(x[:, :1])
    got = ops.moe(gpu, x, router, gu, dn, **kw)
    want = ops.moe(ops.KernelPlan(), x, router, gu, dn, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol * float(np.abs(f32(want)).max()))


def test_supports_and_errors():
    assert supports((E, 2 * I, H), (E, H, I), BF16)
    assert not supports((E, 2 * I, H), (E, H, I + 2), BF16)  # down does not match gate_up
    assert not supports((4096, 2 * 1024, 1024), (4096, 1024, 1024), BF16)  # 2^33 elements: int32 offsets overflow
    x, experts, gu, dn = inputs(1, 1, 2, jnp.float32)
    with pytest.raises(ValueError, match="experts"):
        moe_experts(x, experts[:1], gu, dn, top_k=2)
