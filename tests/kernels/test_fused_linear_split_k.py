"""fused_linear_split_k (kernels_pallas/fused_linear_split_k.py) on CPU, in Pallas' interpreter:
the one-row projection split over K == ref_fused_linear within the output's rounding, for FP8
weights through the float16 tensor-core stream and bf16 weights through either stream, each
prologue it takes (with the RMSNorm hand-over), bias and residual; which shapes and dtypes take
it (the device's exact rows), and that jspec.ops routes one such row to it."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jspec import ops
from kernels_pallas import fused_linear_split_k as flk
from kernels_pallas import tuning
from kernels_pallas.fused_linear import ref_fused_linear
from kernels_pallas.fused_linear_split_k import fused_linear_split_k, split_k_blocks
from tests.helpers.lowering import custom_calls, lower
from tests.kernels.test_fp8_kernels import fp8
from tests.kernels.test_fused_linear import f32, linear_inputs

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn


def ulps(got, want):
    """Largest difference in units of the last place of bf16 at ``want``'s magnitude."""
    g, w = np.asarray(f32(got), np.float64), np.asarray(f32(want), np.float64)
    return float(np.max(np.abs(g - w) / (np.maximum(np.abs(w), 1e-3) * 2.0**-7)))


@pytest.mark.parametrize("weights,mma", [("fp8", True), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("prologue,bias,residual,handoff", [
    ("none", False, True, False), ("none", True, False, False), ("silu_mul", False, True, False),
    ("silu_mul", False, True, True)])
def test_matches_the_reference(weights, mma, splits, prologue, bias, residual, handoff):
    F, K = 64, 1024
    x, w, kw = linear_inputs(splits + 3 * (prologue == "silu_mul"), F, K, prologue, BF16, bias=bias, residual=residual)
    w, scale = fp8(w) if weights == "fp8" else (w, None)
    if handoff:  # the post-attention RMSNorm handed over: x's gate|up scaled by 1 / rms inside
        kw["sumsq"] = jnp.full((1, 1, 3), 0.7 * F / 3, jnp.float32)
    blocks = (splits, 16, 128, 4, 3, mma)
    got = fused_linear_split_k(x, w, interpret=True, blocks=blocks, w_scale=scale, **kw)
    want = ref_fused_linear(x, w, w_scale=scale, **kw)
    assert got.shape == want.shape == (1, 1, F) and got.dtype == want.dtype == BF16
    assert ulps(got, want) <= 2.0  # the partials' order of additions against the reference's


def test_which_shapes_split():
    """The device's rows list exact shapes (the H200's: the 8B's and the 70B's FP8 down_proj,
    the CPU's default); bf16 weights and float32 activations keep the one-pass stream; bad
    calls are errors naming what is wrong."""
    assert split_k_blocks(4096, 14336, FP8, BF16) == (4, 64, 256, 4, 4, True)
    assert split_k_blocks(4096, 14336, BF16, BF16) is None
    assert split_k_blocks(4096, 14336, FP8, jnp.float32) is None  # no float16 dot for f32 activations
    assert split_k_blocks(8192, 28672, FP8, BF16) == (4, 128, 256, 4, 3, True)
    assert split_k_blocks(6144, 4096, FP8, BF16) is None and split_k_blocks(8192, 14336, FP8, BF16) is None
    x, w, kw = linear_inputs(1, 64, 1024, "rmsnorm", BF16)
    with pytest.raises(ValueError, match=r"prologue in \('none', 'silu_mul'\).*prologue 'rmsnorm'"):
        fused_linear_split_k(x, w, prologue="rmsnorm", interpret=True, blocks=(2, 16, 128, 4, 3, True))
    x, w, kw = linear_inputs(1, 64, 1024, "none", BF16)
    with pytest.raises(ValueError, match=r"a split for the \[64, 1024\] weight"):
        fused_linear_split_k(x, w, interpret=True, **kw)


@pytest.fixture
def tiny_split(monkeypatch):
    """The device's rows with a split for the [64, 1024] test weight."""
    row = (64, 1024, 2, tuning.LinearTile(0, 0, 16, 128, 4, 3))
    rows = dataclasses.replace(tuning.device_tuning(), linear_fp8_split_k=(row,))
    monkeypatch.setattr(flk, "device_tuning", lambda device=None: rows)


def test_ops_routes_a_listed_fp8_row_here(tiny_split, gpu_target):
    """jspec.ops sends one row of a listed FP8 weight (down_proj's SwiGLU prologue, the norm
    handed over, the residual) to the split kernel, in interpret mode as on the GPU; more rows,
    or a bf16 weight, go elsewhere."""
    from jspec.quantization import quantize_fp8

    x, w, kw = linear_inputs(7, 64, 1024, "silu_mul", BF16, residual=True)
    q = quantize_fp8(w, None, "bfloat16")
    sumsq = jnp.full((1, 1, 2), 40.0, jnp.float32)
    run = lambda plan, x, w: ops._fused_linear(plan, x, w, kernel=True, prologue="silu_mul", eps=1e-5,  # noqa: E731
                                               residual=kw["residual"], sumsq=sumsq)
    got = run(ops.KernelPlan(linear=ops.GPU(interpret=True)), x, q)
    want = ref_fused_linear(x, q.w, prologue="silu_mul", eps=1e-5, residual=kw["residual"], sumsq=sumsq,
                            w_scale=q.scale.reshape(-1))
    assert ulps(got, want) <= 2.0
    names = [n for _, n in custom_calls(lower(lambda x, w: run(ops.KernelPlan(linear=ops.GPU()), x, w), (x, q), "cuda"))]
    assert len(names) == 1 and re.fullmatch(r"fused_linear_split_k_silu_mul_s2_f16_d128_mma_fp8", names[0]), names
    names = [n for _, n in custom_calls(lower(lambda x, w: run(ops.KernelPlan(linear=ops.GPU()), x, w), (x, w), "cuda"))]
    assert len(names) == 1 and names[0].startswith("fused_linear_silu_mul_"), names  # bf16: the one pass
