"""Verification-width projections (2-16 rows) with the layer's RMSNorms, residual adds and
SwiGLU fused: each weight is streamed once for all rows.

    y = [residual +] ((x @ W.T) [* 1 / rms] [+ bias])        x: [R, K], 2 <= R <= MAX_ROWS
        [-> also y * next_norm_w and per-program sums of y^2: the next RMSNorm handed over]
    swiglu: W = gate|up [2I, K], out = silu(g) * u [R, I]

The contract, the jnp reference and the RMSNorm hand-over are fused_linear.py's
(``ref_fused_linear``); here they serve the K + 1 rows of a verification step at batch 1.
A handed-over norm comes in as x = h * norm_w with ``sumsq`` (sums of h^2) and each row's
1 / rms scales the dot's f32 result: the factored RMSNorm of fused_linear's kernel, with
the norm's statistics made by the projection before (jspec.ops: o_proj hands the
post-attention norm to gate_up, down_proj the next layer's input norm to its qkv).

Why: at Q = 16 every projection of a layer ran through XLA's GEMMs, with the RMSNorms,
residual adds and SwiGLU as ~11 us a layer of small XLA kernels around them (441 kernels
per Llama-3.1-8B verification forward): T(16) / T(1) = 1.10 by GPU time (H100,
scripts/bench.py --section verify, 2026-11-27). With these kernels: 251 kernels, 1.033
(after the tile sweep in kernels_pallas/tuning.py; docs/benchmarks.md).

Kernel (Pallas, Triton backend): fused_linear's tensor-core weight stream with its 16-row
operand filled: grid over blocks of ``block_f`` output features, each program loops over K
in ``block_d`` chunks and feeds [16, block_d] of x (masked loads give zeros past row R)
against the [block_f, block_d] weight tile to a dot, accumulating [16, block_f]; stores are
masked to the R rows. Every program reads all of x from L2 besides its weight rows. With
swiglu each program streams its block of gate rows and the matching up rows (two row blocks
of one weight) into two accumulators. bf16 / f16 weights only (an f32 dot runs in TF32), or
FP8 ones with bf16 / f16 activations and a per-channel ``w_scale`` (fused_linear's FP8 form:
each tile converted to x's dtype for the dot, the scale on its f32 result).

No prologue: a first version applied the RMSNorm (per-row sums of x^2 accumulated in the
loop) and down_proj's SwiGLU inside the loop, as fused_linear does at one row. On the H100
at 16 rows (2026-11-27, scripts/bench_linear.py --rows) qkv + RMSNorm took 30-50 us against
XLA's 24 (norm + GEMM), and down + SwiGLU 244-410 us against 48: every program recomputes
the prologue over all R x K inputs.

Measured (H100, 16 rows, GPU time per call, raw docs/bench/2026-11-27_linear_rows_h100.log):
qkv [6144, 4096] on a handed-over norm 19.6 us (XLA 21.2 without the norm's two kernels);
o [4096, 4096] + residual + hand-over 15.6 (XLA 18.3); gate_up [28672, 4096] + SwiGLU 80.7
(XLA 85.9); down [4096, 14336] + residual + hand-over 43.6 (XLA 47.7).

Numerics: as fused_linear's kernel, row by row: f32 accumulation, the output rounded to
the activation dtype before bias and residual; the SwiGLU product rounded op by op.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import (
    _pow2_divisor,
    dot_dtype,
    k_block,
    k_loop,
    pad_sumsq,
    ref_fused_linear,
    silu_mul,
    silu_mul_rounded,
    validate,
)
from kernels_pallas.tuning import device_tuning

MAX_ROWS = 16  # the tensor-core operand's rows: more rows run XLA's GEMMs
_MMA_ROWS = 16


def default_blocks(F: int, K: int, dtype, swiglu: bool = False):
    """(block_f, block_d, num_warps, num_stages) for a ``dtype`` weight [F, K], or None: bf16 /
    f16 weights that a row of the device's table (kernels_pallas/tuning.py, ``linear_rows``;
    ``linear_rows_swiglu`` for a gate|up weight streamed with its SwiGLU) takes and its
    tiles divide (swiglu: each half [F / 2, K])."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or (swiglu and F % 2):
        return None
    t = device_tuning().rows_tile(F, K, swiglu=swiglu)
    if t is None:
        return None
    bf, bd = _pow2_divisor(F // 2 if swiglu else F, t.block_f, 16), k_block(K, t.block_d)
    return (bf, bd, t.num_warps, t.num_stages) if bf and bd else None


def _kernel(*refs, R, K, block_f, block_d, eps, has_scale, has_sumsq, has_bias, has_res, has_next, swiglu):
    # refs: x [R, K] (whole), w [block_f, K] (this program's rows; with swiglu two refs,
    # its gate rows and its up rows), [w_scale f32[F] (whole; an FP8 weight's)], [sumsq
    # f32[R, n] (whole, n a power of two)], [bias [F]], [residual [R, F]], [next_norm_w [F]], out [R, F] (whole; this program writes its
    # columns; swiglu: silu(g) * u [R, F / 2]), [out * next_norm_w [R, F], f32[R, programs]
    # (this program's sums of out^2, per row)].
    x_ref, *w_refs = refs[:3 if swiglu else 2]
    rest = list(refs[len(w_refs) + 1:])
    scale_ref = rest.pop(0) if has_scale else None
    sumsq_ref = rest.pop(0) if has_sumsq else None
    bias_ref = rest.pop(0) if has_bias else None
    res_ref = rest.pop(0) if has_res else None
    next_ref = rest.pop(0) if has_next else None
    o_ref, *next_outs = rest
    f32, M = jnp.float32, _MMA_ROWS
    live = lambda n: lax.broadcasted_iota(jnp.int32, (M, n), 0) < R  # noqa: E731
    rows = lambda ref, cols: ref.at[pl.ds(0, M), cols]  # noqa: E731  (a [16, n] view; rows >= R masked)
    dt = dot_dtype(x_ref.dtype, w_refs[0].dtype)  # an FP8 tile enters the dot in x's dtype

    def chunk(d0, accs, inside):  # inside: the last chunk's columns within K (fused_linear.k_loop)
        cols = pl.ds(d0, block_d)
        xmask = live(block_d) if inside is None else live(block_d) & inside[None, :]
        xs = plt.load(rows(x_ref, cols), mask=xmask, other=0.0).astype(dt)  # [M, block_d]
        if inside is None:
            return tuple(a + plt.dot(xs, w[:, cols].astype(dt), trans_b=True) for a, w in zip(accs, w_refs))
        wmask = jnp.broadcast_to(inside[None, :], (block_f, block_d))
        return tuple(a + plt.dot(xs, plt.load(w.at[:, cols], mask=wmask, other=0).astype(dt), trans_b=True)
                     for a, w in zip(accs, w_refs))

    ys = k_loop(K, block_d, chunk, tuple(jnp.zeros((M, block_f), f32) for _ in w_refs))  # [M, block_f]
    if has_sumsq:  # each row's handed-over 1 / rms: the input was norm_w * h
        n = sumsq_ref.shape[1]
        ss = plt.load(rows(sumsq_ref, slice(None)), mask=live(n), other=0.0)
        r = lax.rsqrt(jnp.sum(ss, axis=1) / K + eps)[:, None]
        ys = tuple(y * r for y in ys)
    i = pl.program_id(0)
    cols = pl.ds(i * block_f, block_f)
    if has_scale:  # an FP8 weight's per-channel scales (with swiglu: the up rows' past the gate rows')
        n_out = o_ref.shape[1]
        ys = tuple(y * scale_ref[pl.ds(i * block_f + j * n_out, block_f)][None, :] for j, y in enumerate(ys))
    ys = tuple(y.astype(o_ref.dtype) for y in ys)  # the matmul's output rounding, as in the reference
    if swiglu:  # rounded op by op as jax.nn.silu(g) * u
        g, u = (y.astype(f32) for y in ys)
        plt.store(rows(o_ref, cols), silu_mul_rounded(g, u, o_ref.dtype).astype(o_ref.dtype), mask=live(block_f))
        return
    (y,) = ys
    if has_bias:
        y = (y.astype(f32) + bias_ref[cols].astype(f32)[None, :]).astype(o_ref.dtype)
    if has_res:
        r = plt.load(rows(res_ref, cols), mask=live(block_f), other=0.0)
        y = (r.astype(f32) + y.astype(f32)).astype(o_ref.dtype)
    plt.store(rows(o_ref, cols), y, mask=live(block_f))
    if has_next:
        hn_ref, ss_ref = next_outs
        yf = y.astype(f32)
        plt.store(rows(hn_ref, cols), (yf * next_ref[cols].astype(f32)[None, :]).astype(hn_ref.dtype),
                  mask=live(block_f))
        plt.store(rows(ss_ref, pl.ds(i, 1)), jnp.sum(yf * yf, axis=1, keepdims=True), mask=live(1))


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "blocks", "interpret", "swiglu"))
def fused_linear_rows_gpu(x, w, bias=None, residual=None, *, eps=1e-6, out_dtype=None, blocks=None, interpret=False,
                          sumsq=None, next_norm_w=None, swiglu=False, w_scale=None):
    """The kernel on R rows, x: [R, K] (2 <= R <= MAX_ROWS). blocks: (block_f, block_d,
    num_warps, num_stages), or None for default_blocks. sumsq f32[R, n]: x is an RMSNorm's
    input times its weight, handed over; next_norm_w [F]: hand the next RMSNorm over (both
    as in fused_linear.ref_fused_linear); with next_norm_w it returns (y, y * next_norm_w,
    f32[R, programs]). A sumsq whose n is not a power of two is zero-padded here (Triton
    loads power-of-two blocks). swiglu: w is a gate|up weight [2I, K]; each program streams
    block_f gate rows and the matching up rows and writes silu(g) * u [R, I] (no bias,
    residual or hand-over out). w_scale f32[F]: an FP8 weight's per-channel scale."""
    R = x.shape[0]
    F, K = w.shape
    dt = dot_dtype(x.dtype, w.dtype)
    bf, bd, warps, stages = blocks or default_blocks(F, K, w.dtype, swiglu=swiglu)
    whole = pl.BlockSpec()
    sumsq = None if sumsq is None else pad_sumsq(sumsq)
    ws = [w, w] if swiglu else [w]  # the gate and up halves: the same array, two row blocks
    n_out = F // 2 if swiglu else F
    inputs = [x, *ws] + [a for a in (w_scale, sumsq, bias, residual, next_norm_w) if a is not None]
    w_specs = [pl.BlockSpec((bf, K), lambda i: (i, 0))]
    if swiglu:
        w_specs.append(pl.BlockSpec((bf, K), lambda i: (i + n_out // bf, 0)))
    in_specs = [whole, *w_specs] + [whole] * (len(inputs) - 1 - len(ws))
    dt = jnp.dtype(out_dtype or dt)
    F = n_out
    out_shape = jax.ShapeDtypeStruct((R, F), dt)
    if next_norm_w is not None:
        out_shape = (out_shape, out_shape, jax.ShapeDtypeStruct((R, F // bf), jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, R=R, K=K, block_f=bf, block_d=bd, eps=eps, has_scale=w_scale is not None,
                          has_sumsq=sumsq is not None,
                          has_bias=bias is not None, has_res=residual is not None, has_next=next_norm_w is not None,
                          swiglu=swiglu),
        grid=(F // bf,),
        in_specs=in_specs,
        out_specs=(whole, whole, whole) if next_norm_w is not None else whole,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"fused_linear_rows_r{R}_f{bf}_d{bd}{'_swiglu' if swiglu else ''}{'_norm_in' if sumsq is not None else ''}"
             f"{'_norm_out' if next_norm_w is not None else ''}{'_fp8' if w_scale is not None else ''}",
    )(*inputs)


def supports(rows: int, w_shape, dtype, swiglu: bool = False) -> bool:
    """The kernel's contract: 2 to MAX_ROWS rows of x and a bf16 / f16 weight [F, K] that a
    row of the device's table takes (default_blocks). FP8 weights take the kernel with tiles
    given only: XLA's dot with the FP8 values converted in the GEMM was faster at 4 and 16
    rows on the H200 (2026-11-30, scripts/bench_linear.py --fp8 --rows 4,16: qkv 16.2 us
    against 10.4, gate_up + SwiGLU 49.2 against 32.2, down 33.8 against 19.8; raw
    docs/bench/2026-11-30_linear_rows_fp8_h200.log): the tensor-core dot converts each tile. Whether a model's projection is worth
    the kernel is decided elsewhere (jspec.ops.linear_kernel, jspec.ops.mlp)."""
    return 2 <= rows <= MAX_ROWS and default_blocks(*w_shape, dtype, swiglu=swiglu) is not None


def ref_fused_linear_rows(x, w, *, swiglu=False, **kw):
    """The reference: fused_linear.ref_fused_linear, then with swiglu silu(g) * u of its
    gate|up output."""
    _validate_swiglu(w, swiglu, kw.get("bias"), kw.get("residual"), kw.get("next_norm_w"), kw.get("out_dtype"))
    y = ref_fused_linear(x, w, **kw)
    return silu_mul(y) if swiglu else y


def _validate_swiglu(w, swiglu, bias, residual, next_norm_w, out_dtype):
    if swiglu and (w.shape[0] % 2 or bias is not None or residual is not None or next_norm_w is not None
                   or out_dtype is not None):
        raise ValueError(f"fused_linear_rows: swiglu takes a gate|up weight of even rows (got {w.shape}) and no "
                         "bias, residual, next_norm_w or out_dtype")


def fused_linear_rows(x, w, *, eps=1e-6, bias=None, residual=None, out_dtype=None, sumsq=None, next_norm_w=None,
                      blocks=None, swiglu=False, interpret=False, w_scale=None):
    """Public entry: the kernel, fused_linear's arguments without a prologue (x [..., K] of
    2..MAX_ROWS rows in all; sumsq: a handed-over input RMSNorm; the reference:
    ref_fused_linear_rows), on what ``supports`` says (``blocks`` given: any bf16 / f16
    weight whose rows they divide and whose K is a multiple of 16, the last K chunk masked);
    ``interpret``: its body in Pallas' interpreter. With next_norm_w
    -> (y, y * next_norm_w, f32[..., n] partial sums of y^2). swiglu: w is a gate|up weight
    [2I, K] and the result silu(g) * u [..., I] (no bias, residual, hand-over out or
    out_dtype)."""
    validate(x, w, "none", None, bias, residual, out_dtype, sumsq, next_norm_w, w_scale=w_scale)
    _validate_swiglu(w, swiglu, bias, residual, next_norm_w, out_dtype)
    lead, F = x.shape[:-1], w.shape[0]
    R, dt = math.prod(lead), dot_dtype(x.dtype, w.dtype)
    ok = (2 <= R <= MAX_ROWS and dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and w.shape[0] // (1 + swiglu) % blocks[0] == 0 and w.shape[1] % 16 == 0) if blocks \
        else supports(R, w.shape, w.dtype, swiglu=swiglu)
    if not ok:
        raise ValueError(f"fused_linear_rows: the kernel takes 2 to {MAX_ROWS} rows and a bf16 / f16 weight its "
                         f"tiles take, got {R} rows and a {w.dtype} {w.shape} weight")
    out = fused_linear_rows_gpu(
        x.reshape(R, x.shape[-1]), w, bias, None if residual is None else residual.reshape(R, F), eps=float(eps),
        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name, interpret=interpret,
        sumsq=None if sumsq is None else sumsq.reshape(R, sumsq.shape[-1]), next_norm_w=next_norm_w, blocks=blocks,
        swiglu=swiglu, w_scale=w_scale,
    )
    if next_norm_w is None:
        return out.reshape(lead + out.shape[-1:])
    y, hn, ss = out
    return y.reshape(lead + (F,)), hn.reshape(lead + (F,)), ss.reshape(lead + ss.shape[-1:])
