"""One-row projections split over K: more programs for a weight whose one-pass stream has
too few to keep the memory busy.

    y = [residual +] (prologue(x) @ W.T [+ bias])
    prologue: "none" | "silu_mul" (SwiGLU, gate|up fused; with ``sumsq``, the RMSNorm
              handed over from o_proj: fused_linear.py)

Kernel (Pallas, Triton backend): grid (F / block_f, S). Program (i, s) streams rows
[i * block_f, (i + 1) * block_f) of W over columns [s * K / S, (s + 1) * K / S) through
fused_linear.stream_rows (the float16 tensor-core dot of an FP8 tile, or the elementwise
form) into f32 partial sums [S, F]; XLA's fusion after it adds the S partials and finishes
as fused_linear's epilogue does (the per-channel scale, the rounding to the output dtype,
then bias and residual in that dtype).

Why: an FP8 down_proj [4096, 14336] of Llama-3.1-8B at one row streamed in 22.33 us through
fused_linear's one pass (128 programs of 32 rows over all of K; H200, 2026-12-01) against
13.3 us of bytes; four ways over K (256 programs of 64 rows x 3,584), the sum included, 18.27
us (scripts/probe_fp8_splitk.py in git history, 25f5322; docs/decisions.md 2026-12-01).
Which shapes take it: kernels_pallas/tuning.py ``linear_fp8_split_k`` (exact shapes measured);
jspec/ops.py routes one row of such a weight here.

Numerics: f32 partials added in f32 (another order of additions than the one pass: results
within an ulp of the output dtype of ``ref_fused_linear``'s, which is the reference).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import _pow2_divisor, dot_dtype, pad_sumsq, stream_rows, validate
from kernels_pallas.paged_attention import is_fp8
from kernels_pallas.tuning import device_tuning

PROLOGUES = ("none", "silu_mul")


def split_k_blocks(F: int, K: int, dtype, x_dtype) -> tuple | None:
    """(splits, block_f, block_d, num_warps, num_stages, mma) for one row of a ``dtype`` weight
    [F, K] with ``x_dtype`` activations, or None where the device lists no split for it: FP8
    weights (their float16 tensor-core stream needs bf16 / f16 activations), each split a whole
    number of block_d chunks."""
    if not is_fp8(dtype) or jnp.dtype(x_dtype) == jnp.float32:
        return None
    row = device_tuning().split_k_tile(F, K)
    if row is None:
        return None
    S, t = row
    bf = _pow2_divisor(F, t.block_f, 16)
    if K % S or (K // S) % t.block_d or not bf:
        return None
    return S, bf, t.block_d, t.num_warps, t.num_stages, True


def _kernel(*refs, prologue, F, K, splits, block_d, eps, has_sumsq, mma):
    # refs: x [1, K_in] (whole), w [block_f, K / S] (this program's slice), [sumsq f32[1, n]
    # (whole)], out f32 [1, block_f] (row s of the partials, this program's columns)
    x_ref, w_ref, *rest = refs
    sumsq_ref = rest.pop(0) if has_sumsq else None
    (o_ref,) = rest
    Ks = K // splits
    scale = None
    if has_sumsq:  # the handed-over RMSNorm's 1 / rms (the residual stream: the output's width)
        scale = lax.rsqrt(jnp.sum(sumsq_ref[0, :]) / F + eps)
    x0 = pl.multiple_of(pl.program_id(1) * Ks, block_d)
    (y,) = stream_rows(x_ref, [w_ref], None, prologue=prologue, K=Ks, block_d=block_d, eps=eps, mma=mma,
                       scale=scale, x0=x0, up=K)
    o_ref[0, :] = y


@functools.partial(jax.jit, static_argnames=("prologue", "eps", "out_dtype", "blocks", "interpret"))
def fused_linear_split_k_gpu(x, w, bias=None, residual=None, *, prologue="none", eps=1e-6, out_dtype=None,
                             blocks=None, interpret=False, sumsq=None, w_scale=None):
    """The kernel and its epilogue on one row, x: [1, K_in]. blocks: split_k_blocks' tuple
    (None: split_k_blocks). sumsq f32[1, n]: the RMSNorm hand-over (silu_mul)."""
    F, K = w.shape
    S, bf, bd, warps, stages, mma = blocks or split_k_blocks(F, K, w.dtype, x.dtype)
    whole = pl.BlockSpec()
    sumsq = None if sumsq is None else pad_sumsq(sumsq)
    inputs = [x, w] + ([sumsq] if sumsq is not None else [])
    in_specs = [whole, pl.BlockSpec((bf, K // S), lambda i, s: (i, s))] + [whole] * (len(inputs) - 2)
    parts = pl.pallas_call(
        functools.partial(_kernel, prologue=prologue, F=F, K=K, splits=S, block_d=bd, eps=eps,
                          has_sumsq=sumsq is not None, mma=mma),
        grid=(F // bf, S),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, bf), lambda i, s: (s, i)),
        out_shape=jax.ShapeDtypeStruct((S, F), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"fused_linear_split_k_{prologue}_s{S}_f{bf}_d{bd}{'_mma' if mma else ''}"
             f"{'_fp8' if w_scale is not None else ''}",
    )(*inputs)
    f32 = jnp.float32
    y = jnp.sum(parts, axis=0, keepdims=True)
    if w_scale is not None:  # before the rounding, as fused_linear's epilogue
        y = y * w_scale
    dt = jnp.dtype(out_dtype or dot_dtype(x.dtype, w.dtype))
    y = y.astype(dt)
    if bias is not None:
        y = (y.astype(f32) + bias.astype(f32)).astype(dt)
    if residual is not None:
        y = (residual.astype(f32) + y.astype(f32)).astype(dt)
    return y


def fused_linear_split_k(x, w, *, prologue="none", eps=1e-6, bias=None, residual=None, out_dtype=None, sumsq=None,
                         interpret=False, blocks=None, w_scale=None, next_norm_w=None):
    """Public entry: ref_fused_linear's arguments and result on one row ([out, in] weights;
    an FP8 one with its w_scale), no rmsnorm prologue and no next-norm hand-over; blocks: the
    split and tiles (None: split_k_blocks, which must list the shape). ``interpret``: the
    kernel's body in Pallas' interpreter."""
    rows = math.prod(x.shape[:-1])
    F, K = w.shape[-2:]
    blocks = blocks or split_k_blocks(F, K, w.dtype, x.dtype)
    if prologue not in PROLOGUES or next_norm_w is not None or rows != 1 or blocks is None:
        raise ValueError(f"fused_linear_split_k: one row, prologue in {PROLOGUES}, no next_norm_w, and a split for "
                         f"the [{F}, {K}] weight; got {rows} rows, prologue {prologue!r}, blocks {blocks}")
    if sumsq is not None and prologue != "silu_mul":
        raise ValueError("fused_linear_split_k: a handed-over sumsq goes with the silu_mul prologue")
    validate(x, w, prologue, None, bias, residual, out_dtype, sumsq, w_scale=w_scale)
    lead = x.shape[:-1]
    y = fused_linear_split_k_gpu(
        x.reshape(1, x.shape[-1]), w, bias, None if residual is None else residual.reshape(1, F), prologue=prologue,
        eps=float(eps), out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name, blocks=blocks,
        interpret=interpret, sumsq=None if sumsq is None else sumsq.reshape(1, sumsq.shape[-1]), w_scale=w_scale)
    return y.reshape(lead + (F,))
