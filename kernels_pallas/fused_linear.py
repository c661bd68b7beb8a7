"""Batch-1 linear layers with their neighbours fused: one kernel streams W once.

    y = [residual +] (prologue(x) @ W.T [+ bias])
    prologue: "none"     h = x
              "rmsnorm"  h = rms_norm(x, norm_w, eps)          (Llama/Qwen3 RMSNorm)
              "silu_mul" h = silu(x[:, :K]) * x[:, K:]          (SwiGLU, gate|up fused)

Why: a batch-1 decode step of a Llama-3.1-8B shape was 4.59 ms of GPU time on the H200
(jax 0.11.2, 2026-11-21, profiler): XLA's GEMVs stream the weights at ~4 TB/s, but each
layer also ran ~8 tiny XLA kernels (two RMSNorm reductions, two residual adds, the
silu*mul, RoPE, the KV scatter) of 1.2-3.6 us each: ~0.55 ms per step, 12% of it, for a
few KB of data. Here the norm, the SwiGLU product, the bias and the residual add ride
along with the weight stream (RoPE and the KV write: kernels_pallas/rope_kv_write.py).
With both, the step is 4.31 ms of GPU time (scripts/bench.py --section diag).

Kernel (Pallas, Triton backend): grid over blocks of ``block_f`` output features; each
program loops over K in ``block_d`` chunks (the last one masked where none of a useful
length divides K: k_block). For bf16 / f16 weights each [block_f, block_d]
tile goes through a tensor-core dot against h in row 0 of a 16-row operand: the MMA is
1/16 used, but compute is not the bound, and Triton software-pipelines a dot's operand
loads through shared memory (num_stages deep), which it does not do for the elementwise
form; that keeps more weight bytes in flight (default_mma_blocks: 3-12% faster on the
H200). f32 weights (a dot would run in TF32) and shapes no MMA tile divides use the
elementwise form: w * x accumulated in an f32 [block_f, block_d] tile, reduced once at the
end. One row only: a first version that gathered up to 16 rows into one elementwise stream
was slower than XLA for M = 2-16 (qkv 22 vs 18 us); 2-16 rows take the tensor-core form
with its 16-row operand filled, fused_linear_rows.py (jspec.ops.linear_kernel).
The RMSNorm is factored out of the dot: W (w_norm * x) and sum(x^2) accumulate in the same
pass and 1 / rms scales the result, instead of a first pass over x in every program.

A decoder layer also hands its post-attention RMSNorm from o_proj's kernel to down_proj's
(jspec.ops.linear_then_norm): o_proj writes h * norm_w and per-program sums of h^2 besides
h, so the norm needs no kernel of its own before XLA's gate_up GEMM.

FP8 weights (float8_e4m3fn, weight-only: jspec/quantization.py) with ``w_scale`` f32[F], one
scale per output channel: each tile enters the dot converted to the activations' dtype (every
e4m3 value is exact in bf16 / f16 / f32), the f32 result times the scale before its
rounding; the weight streams at a byte an element (dot_dtype). FP8 weights take the
elementwise stream, except the shapes tuning.py's ``linear_fp8_mma`` lists (the 8B's gate_up, the
70B's gate_up and o), whose tiles go through a float16 tensor-core dot (F16_SHIFT): on the H200 gate_up [28672, 4096]
30.5 us against the elementwise 40.7 and XLA's 42; qkv, o, down 11.7 / 9.5 / 29.2 against the
elementwise 10.9 / 7.5 / 23.6 (2026-12-01, docs/decisions.md).

Numerics: f32 accumulation, the output rounded to the activation dtype, then bias and
residual added in that dtype, as the reference's XLA ops do. The SwiGLU product is rounded
op by op like jax.nn.silu(g) * u in bf16. The factored RMSNorm rounds w_norm * x to the
weight dtype where the reference rounds x / rms and then w_norm * (x / rms): results
differ by a few ulps of the activation dtype (tests/kernels/test_fused_linear.py).

Measured on the H200 (2026-11-21, jax 0.11.2, scripts/bench.py --section diag, profiler
GPU time per layer inside a decode step): qkv + RMSNorm 15.9 us, o + residual 10.8, down +
SwiGLU + residual 31.6; before, XLA took 14.6 + ~1.3 (norm), 10.6 + ~1.8 (add) and
29.4 + 2.8 (silu * u) + ~1.8 (add). gate_up stays with XLA (jspec.ops.MAX_KERNEL_FEATURES). Tile
sweep: scripts/bench_linear.py --sweep. With the MMA form (2026-11-21, same method):
o + residual 11.5 us per layer in the step (11.7 before), down 32.7 (33.3); alone
(scripts/bench_linear.py) qkv + RMSNorm 15.6 us (Qwen3's path; Llama's qkv runs in
kernels_pallas/qkv_rope_kv_write.py), o 11.3, down 32.5.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.paged_attention import is_fp8  # an FP8 weight: weight-only, with a per-channel scale
from kernels_pallas.paged_attention_gpu import _next_pow2
from kernels_pallas.tuning import device_tuning

PROLOGUES = ("none", "rmsnorm", "silu_mul")


def dot_dtype(x_dtype, w_dtype):
    """The dtype a weight tile enters its dot in: its own, or for an FP8 weight the
    activations' (exact: every e4m3 value is a bf16 / f16 / f32 value). Also the output's."""
    return jnp.dtype(x_dtype) if is_fp8(w_dtype) else jnp.dtype(w_dtype)


def rms_norm(x, w, eps):
    """HF Llama RMSNorm: normalise in float32, cast back, then scale (in x's dtype)."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def silu_mul(gu):
    """SwiGLU on a fused [..., 2I] gate|up projection."""
    g, u = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(g) * u


def ref_fused_linear(x, w, *, prologue="none", norm_w=None, eps=1e-6, bias=None, residual=None, out_dtype=None,
                     sumsq=None, next_norm_w=None, w_in_out=False, w_scale=None, x_fp8=False):
    """The jnp reference (and the path for large M, TPU and CPU): XLA ops, unfused.

    x: [..., K] ([..., 2K] for silu_mul); w: [F, K] ([K, F] with w_in_out: the CPU layout,
    jspec.ops.KernelPlan.in_out_weights); norm_w: [K]; bias: [F];
    residual: [..., F]; out_dtype: None (dot_dtype: w.dtype, or x.dtype for an FP8 w) or
    float32 (logits); w_scale f32[F]: an FP8 weight's per-channel scale, on the dot's f32
    result before its rounding; x_fp8 (with an e4m3 w): the dot's input, after the prologue,
    quantized to e4m3 per row (dynamic per-token scale max|x| / 448) and the dot run on the
    FP8 values, both scales on its f32 result (W8A8: FP8 tensor cores on the GPU). -> [..., F]
    The RMSNorm hand-over between two projections (jspec.ops.linear_then_norm):
    - next_norm_w [F]: also return the next RMSNorm's input scaled by its weight, un-normalised,
      and the sum of squares of y: (y, y * next_norm_w, f32[..., n] whose sum over n is
      sum(y^2); n = 1 here, one partial per program in the kernel);
    - sumsq f32[..., n], with silu_mul: x is a gate|up projection of such an input; it is
      first scaled by 1 / rms = rsqrt(sum(sumsq) / F + eps), F the width of the normed vector
      (= this projection's output width, the residual stream);
    - sumsq with prologue "none": x is such an input itself (the norm's input times its
      weight), and x @ w.T, in float32, is scaled by 1 / rms = rsqrt(sum(sumsq) / K + eps)
      before its rounding: the RMSNorm factored out of the dot, as the kernels do.
    """
    validate(x, w, prologue, norm_w, bias, residual, out_dtype, sumsq, next_norm_w, w_in_out, w_scale, x_fp8)
    dt = dot_dtype(x.dtype, w.dtype)
    if prologue == "rmsnorm":
        x = rms_norm(x, norm_w, eps)
    elif prologue == "silu_mul":
        if sumsq is not None:
            r = lax.rsqrt(jnp.sum(sumsq, axis=-1, keepdims=True) / w.shape[1 if w_in_out else 0] + eps)
            x = (x.astype(jnp.float32) * r).astype(x.dtype)
        x = silu_mul(x)
    spec = "...d,df->...f" if w_in_out else "...d,fd->...f"
    if (prologue == "none" and sumsq is not None) or w_scale is not None:  # (x_fp8 comes with a w_scale)
        if x_fp8:
            xq, x_scale = quantize_rows(x, w.dtype)
            y = jnp.einsum(spec, xq, w, preferred_element_type=jnp.float32) * x_scale
        else:
            y = jnp.einsum(spec, x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)
        if prologue == "none" and sumsq is not None:
            y = y * lax.rsqrt(jnp.sum(sumsq, axis=-1, keepdims=True) / x.shape[-1] + eps)
        y = (y if w_scale is None else y * w_scale).astype(out_dtype or dt)
    else:
        y = jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=out_dtype)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = residual + y
    if next_norm_w is None:
        return y
    yf = y.astype(jnp.float32)
    return y, (yf * next_norm_w.astype(jnp.float32)).astype(y.dtype), jnp.sum(yf * yf, axis=-1, keepdims=True)


def quantize_rows(x, dtype=jnp.float8_e4m3fn):
    """x [..., K] as FP8 values with one scale a row: (x * (1 / s) rounded to ``dtype``, f32 s
    [..., 1]), s = max|x| * (1 / the format's largest finite value) (a row of zeros: its
    floor), in float32: vLLM's per-token quantization, written as products by reciprocals,
    which XLA keeps as written (a division by a constant it would turn into one)."""
    top = float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    s = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) * jnp.float32(1 / top)
    return jnp.clip(xf * (1 / s), -top, top).astype(dtype), s


def validate(x, w, prologue, norm_w, bias, residual, out_dtype, sumsq=None, next_norm_w=None, w_in_out=False,
             w_scale=None, x_fp8=False):
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if w.ndim != 2:
        raise ValueError(f"weight must be [out_features, in_features], got shape {w.shape}")
    F, K = w.shape[::-1] if w_in_out else w.shape
    k_in = 2 * K if prologue == "silu_mul" else K
    if x.shape[-1] != k_in:
        raise ValueError(f"x has {x.shape[-1]} features, the weight [{F}, {K}] with prologue {prologue!r} needs {k_in}")
    if prologue == "rmsnorm" and (norm_w is None or norm_w.shape != (K,)):
        raise ValueError(f"rmsnorm prologue needs norm_w of shape ({K},), got {None if norm_w is None else norm_w.shape}")
    if bias is not None and bias.shape != (F,):
        raise ValueError(f"bias must have shape ({F},), got {bias.shape}")
    if residual is not None and residual.shape != x.shape[:-1] + (F,):
        raise ValueError(f"residual must have shape {x.shape[:-1] + (F,)}, got {residual.shape}")
    if out_dtype is not None and residual is not None and jnp.dtype(out_dtype) != residual.dtype:
        raise ValueError(f"out_dtype {out_dtype} with a {residual.dtype} residual")
    if sumsq is not None and (prologue == "rmsnorm" or sumsq.shape[:-1] != x.shape[:-1]):
        raise ValueError(f"sumsq (shape {sumsq.shape}) goes with the silu_mul or no prologue and one row per row of x "
                         f"{x.shape}")
    if next_norm_w is not None and next_norm_w.shape != (F,):
        raise ValueError(f"next_norm_w must have shape ({F},), got {next_norm_w.shape}")
    if is_fp8(w.dtype) != (w_scale is not None):
        raise ValueError(f"a {w.dtype} weight takes {'a' if is_fp8(w.dtype) else 'no'} w_scale "
                         f"(its per-channel scale)")
    if w_scale is not None and (w_scale.shape != (F,) or w_scale.dtype != jnp.float32):
        raise ValueError(f"w_scale must be float32 of shape ({F},), got {w_scale.dtype}{list(w_scale.shape)}")
    if x_fp8 and jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"x_fp8 (FP8 activations) takes an e4m3 weight, got {w.dtype}")


def _pow2_divisor(n: int, pref: int, least: int) -> int:
    """Largest power of two in [least, pref] dividing n, else 0."""
    b = pref
    while b >= least and n % b:
        b //= 2
    return b if b >= least else 0


def k_block(K: int, pref: int) -> int:
    """The K loop's chunk: the largest power of two <= ``pref`` dividing K while that is at
    least pref / 2 (or K is shorter than pref), else ``pref`` with a masked last chunk
    (stream_rows). gpt-oss's K = 2880 = 2^6 * 45 divides into 64s only: 45 chunks of a few
    hundred bytes per row kept the qkv kernel at 43 us a layer on the H200 where its bytes
    take 6.7 us (docs/benchmarks.md); 5 chunks of 512 and a masked 320 keep more in flight."""
    d = _pow2_divisor(K, pref, 32)
    # rows of a K that is no multiple of 16 are not 32-byte aligned: none of them streams well
    return d if d * 2 >= pref or K < pref or K % 16 else pref


def k_loop(K: int, block_d: int, chunk, carry):
    """``chunk(d0, carry, inside)`` over K in block_d steps -> the last carry: the whole
    chunks in one loop with ``inside`` None, then, where block_d does not divide K (k_block),
    the last one with ``inside`` its [block_d] columns within K (the chunk masks its loads
    past K to zeros). That last chunk is a loop of one trip: its start traced, since JAX
    refuses a static slice past a ref's end."""
    full = K // block_d
    carry = lax.fori_loop(0, full, lambda i, c: chunk(pl.multiple_of(i * block_d, block_d), c, None), carry)
    if K % block_d:
        iota = lax.broadcasted_iota(jnp.int32, (block_d,), 0)
        carry = lax.fori_loop(full, full + 1, lambda i, c: chunk(i * block_d, c, i * block_d + iota < K), carry)
    return carry


def pad_sumsq(sumsq):
    """A handed-over f32[R, n] of partial sums of x^2, zero-padded to a power-of-two n
    (Triton loads power-of-two blocks; the zeros add nothing to the row sums)."""
    n = sumsq.shape[-1]
    return sumsq if n & (n - 1) == 0 else jnp.pad(sumsq, ((0, 0), (0, _next_pow2(n) - n)))


def default_blocks(F: int, K: int, fp8: bool = False):
    """(block_f, block_d, num_warps, num_stages), or None when no tile divides the shape:
    the device's elementwise row (kernels_pallas/tuning.py; ``linear_fp8`` for an FP8
    weight), shrunk to powers of two that divide [F, K]. On the H200: K = 4096 (qkv, o)
    8 x 512 tiles, 4 warps, 4 stages (qkv
    15.9 us, o 10.7; 16 x 512: 16.3 / 11.3); K = 14336 (down) 16 x 1024, 8 warps, 2 stages
    (30.7 us; 16 x 512: 32.9)."""
    t = device_tuning().linear_tile(F, K, mma=False, fp8=fp8)
    bf, bd = _pow2_divisor(F, t.block_f, 2), k_block(K, t.block_d)
    return (bf, bd, t.num_warps, t.num_stages) if bf and bd else None


def default_mma_blocks(F: int, K: int, dtype):
    """fused_linear's default tiles, (block_f, block_d, num_warps, num_stages, True): the
    weight tile feeds a tensor-core dot (h in row 0 of a 16-row operand), which Triton
    software-pipelines through shared memory; the elementwise stream's loads it does not.
    The device's tensor-core row (kernels_pallas/tuning.py). On the H200 (2026-11-21, GPU
    time, scripts/bench_linear.py --sweep; raw results in git history, commit 2f4c831):
    o [4096, 4096] 11.3 us vs 11.8 elementwise, qkv [6144, 4096] + RMSNorm 15.4-16.0 vs
    17.5, down [4096, 14336] + SwiGLU 31.9 vs 33.1. bf16 / f16, and FP8 (float16 dots) where a
    ``linear_fp8_mma`` row takes the shape (an f32 dot would run in TF32); None where no row
    takes the shape (narrower weights: the elementwise stream is faster there) or no tile
    divides it (then default_blocks)."""
    fp8 = is_fp8(dtype)
    if not fp8 and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    t = device_tuning().linear_tile(F, K, mma=True, fp8=fp8)
    if t is None:
        return None
    bf, bd = _pow2_divisor(F, t.block_f, 16), k_block(K, t.block_d)
    return (bf, bd, t.num_warps, t.num_stages, True) if bf and bd else None


def one_row_blocks(F: int, K: int, dtype, x_dtype=None):
    """The one-row stream's tiles for a ``dtype`` weight [F, K]: (block_f, block_d, num_warps,
    num_stages, mma), default_mma_blocks where they divide it (bf16 / f16; FP8 where its float16
    row does, unless ``x_dtype``, the activations', is float32), else default_blocks with mma
    False (FP8: its own rows); None where no tile divides it. fused_linear_gpu's default, and
    moe_experts' for each expert's projection."""
    f32_fp8 = is_fp8(dtype) and x_dtype is not None and jnp.dtype(x_dtype) == jnp.float32  # (no float16 dot)
    t = (None if f32_fp8 else default_mma_blocks(F, K, dtype)) or default_blocks(F, K, fp8=is_fp8(dtype))
    return None if t is None else (*t[:4], len(t) > 4)


def silu_mul_rounded(g, u, dtype):
    """jax.nn.silu(g) * u op by op (negate, exp, add, divide, multiply, multiply) on f32
    values of `dtype` numbers, each result rounded to `dtype` as XLA's bf16 ops are on CPU.
    -> f32 (not yet rounded after the last multiply)."""
    f32 = jnp.float32
    rnd = lambda a: a.astype(dtype).astype(f32)  # noqa: E731
    sig = rnd(1.0 / rnd(1.0 + rnd(jnp.exp(-g))))
    return rnd(g * sig) * u


# An FP8 tile's tensor-core dot runs in float16: sm_89+ converts e4m3 pairs to f16 pairs in one
# instruction, where Triton takes e4m3 to bf16 through f16 and f32 (three conversions a value, on
# the SM's 16-a-clock unit: gate_up [28672, 4096] 30.5 us against 44-47 on the H200). h enters it
# times 2^-F16_SHIFT (exact), so the float16 holds |h| < 2^20 (bf16 activations' values from
# 2^-13 up exactly), and the f32 sums are scaled back.
F16_SHIFT = 4


def stream_rows(x_ref, w_refs, norm_ref, *, prologue, K, block_d, eps, mma=False, scale=None, x0=0, up=None):
    """The weight stream of one program: for each w_ref (rows [n, K] of W), its rows
    times prologue(x), f32 [n], the RMSNorm's 1 / rms applied. A w_ref may also be
    (ref, pl.ds(row0, n)): those rows of a whole weight (Triton takes one indexer per
    load, so no .at[] view). Shared with kernels_pallas/qkv_rope_kv_write.py (two row
    blocks per program) and the ticket-chained MLP experiment (git history, commit 7d2cdd6).
    mma: each [n, block_d] weight tile goes through a tensor-core dot with h in row 0 of
    a [16, block_d] operand (zeros below), accumulating [16, n] (default_mma_blocks).
    scale: an f32 scalar the silu_mul prologue's gate and up values are first multiplied by
    (rounded to x's dtype): the 1 / rms of an RMSNorm handed over (ref_fused_linear).
    A K that block_d does not divide (k_block) ends with one chunk whose loads past K are
    masked to zeros, which add nothing to the dot, the sum of squares or the SwiGLU.
    An FP8 weight's tensor-core dot runs in float16 (F16_SHIFT). x0: where x's columns of this
    stream begin (a slice of K: fused_linear_split_k.py; no rmsnorm prologue); up: where x's
    up half begins for silu_mul (default K)."""
    f32 = jnp.float32
    up = K if up is None else up
    w_refs = [w if isinstance(w, tuple) else (w, slice(None)) for w in w_refs]
    dt = dot_dtype(x_ref.dtype, w_refs[0][0].dtype)  # an FP8 tile enters the dot in x's dtype
    f16_dot = mma and is_fp8(w_refs[0][0].dtype)
    rows_of = [w.shape[0] if isinstance(r, slice) else r.size for w, r in w_refs]

    def chunk(d0, carry, live):  # live: [block_d] bool, the last chunk's columns inside K (k_loop)
        accs, ss = carry

        def ld(ref, rows, cols):  # ref[rows, cols]; zeros past K in the last chunk
            if live is None:
                return ref[rows, cols]
            if isinstance(rows, int):  # x's row: Pallas' load takes slices, not an int index
                return ld(ref, pl.ds(rows, 1), cols)[0]
            n = ref.shape[0] if isinstance(rows, slice) else rows.size
            return plt.load(ref.at[rows, cols], mask=jnp.broadcast_to(live[None, :], (n, block_d)), other=0)

        xs = ld(x_ref, 0, pl.ds(x0 + d0, block_d)).astype(f32)  # [block_d]
        if prologue == "rmsnorm":
            # RMSNorm factored out of the dot: W (nw * x) accumulates in this same pass
            # while sum(x^2) does, and 1 / rms scales the result at the end. A first pass for
            # the rms would put a chain of L2 reads before the first weight load of every
            # program (gate_up: +22 us per call on the H200). x^2 accumulates elementwise and
            # is reduced once after the loop: a reduction per K block (a barrier each) cost
            # the qkv projection 0.5-0.65 us per call on the H200
            # (docs/benchmarks.md; the script is in git history, commit 99d0c50).
            ss = ss + xs * xs
            nw = norm_ref[pl.ds(d0, block_d)] if live is None else plt.load(norm_ref.at[pl.ds(d0, block_d)],
                                                                              mask=live, other=0)
            h = (xs * nw.astype(f32)).astype(dt)
        elif prologue == "silu_mul":
            us = ld(x_ref, 0, pl.ds(up + x0 + d0, block_d)).astype(f32)
            if scale is not None:
                xs, us = (xs * scale).astype(x_ref.dtype).astype(f32), (us * scale).astype(x_ref.dtype).astype(f32)
            h = silu_mul_rounded(xs, us, x_ref.dtype).astype(dt)
        else:
            h = xs.astype(dt)
        if mma:
            mdt = jnp.float16 if f16_dot else dt
            if f16_dot:
                h = (h.astype(f32) * f32(2.0**-F16_SHIFT)).astype(mdt)
            hm = jnp.where(lax.broadcasted_iota(jnp.int32, (16, block_d), 0) == 0, h[None, :], jnp.zeros((), mdt))
            return tuple(a + plt.dot(hm, ld(w, r, pl.ds(d0, block_d)).astype(mdt), trans_b=True)
                         for a, (w, r) in zip(accs, w_refs)), ss
        hf = h.astype(f32)[None, :]
        return tuple(a + ld(w, r, pl.ds(d0, block_d)).astype(f32) * hf for a, (w, r) in zip(accs, w_refs)), ss

    acc_shape = (lambda n: (16, n)) if mma else (lambda n: (n, block_d))
    init = (tuple(jnp.zeros(acc_shape(n), f32) for n in rows_of),
            jnp.zeros((block_d,) if prologue == "rmsnorm" else (), f32))
    accs, ss = k_loop(K, block_d, chunk, init)
    if mma:  # row 0 holds h @ W.T
        ys = [jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 0) == 0, a, 0.0), axis=0) for a in accs]
        if f16_dot:
            ys = [y * f32(2.0**F16_SHIFT) for y in ys]
    else:
        ys = [jnp.sum(a, axis=1) for a in accs]
    if prologue == "rmsnorm":
        ys = [y * lax.rsqrt(jnp.sum(ss) / K + eps) for y in ys]
    return ys


def _kernel(*refs, prologue, K, block_f, block_d, eps, has_scale, has_norm, has_sumsq, has_bias, has_res, has_next,
            mma):
    # refs: x [1, K_in] (whole), w [block_f, K] (this program's rows), [w_scale f32[F]], [norm_w [K]],
    # [sumsq f32[1, n] (whole)], [bias [F]], [residual [1, F]], [next_norm_w [F]],
    # out [1, F] (whole; this program writes its columns), [out * next_norm_w [1, F],
    # f32[1, programs] (this program's sum of out^2)].
    x_ref, w_ref, *rest = refs
    scale_ref = rest.pop(0) if has_scale else None
    norm_ref = rest.pop(0) if has_norm else None
    sumsq_ref = rest.pop(0) if has_sumsq else None
    bias_ref = rest.pop(0) if has_bias else None
    res_ref = rest.pop(0) if has_res else None
    next_ref = rest.pop(0) if has_next else None
    o_ref, *next_outs = rest
    f32 = jnp.float32
    scale = None
    if has_sumsq:  # the handed-over RMSNorm's 1 / rms (the residual stream is this kernel's output width)
        # (Computed before the stream, this load delays the first weight tiles: down_proj
        # + 1.2 us on the H200. Inside the loop's first iteration, under a cond, it broke the
        # pipelining: + 3.2 us. explore_norm_handoff.py in git history, commit 5527950)
        scale = lax.rsqrt(jnp.sum(sumsq_ref[0, :]) / o_ref.shape[1] + eps)
    (y,) = stream_rows(x_ref, [w_ref], norm_ref, prologue=prologue, K=K, block_d=block_d, eps=eps, mma=mma,
                       scale=scale)  # [block_f]
    i = pl.program_id(0)
    cols = pl.ds(i * block_f, block_f)
    if has_scale:  # an FP8 weight's per-channel scale, before the rounding (ref_fused_linear)
        y = y * scale_ref[cols]
    y = y.astype(o_ref.dtype)  # the matmul's output rounding, as in the reference
    if has_bias:
        y = (y.astype(f32) + bias_ref[cols].astype(f32)).astype(o_ref.dtype)
    if has_res:
        y = (res_ref[0, cols].astype(f32) + y.astype(f32)).astype(o_ref.dtype)
    o_ref[0, cols] = y
    if has_next:
        hn_ref, ss_ref = next_outs
        yf = y.astype(f32)
        hn_ref[0, cols] = (yf * next_ref[cols].astype(f32)).astype(hn_ref.dtype)
        ss_ref[0, pl.ds(i, 1)] = jnp.full((1,), jnp.sum(yf * yf), f32)


@functools.partial(jax.jit, static_argnames=("prologue", "eps", "out_dtype", "blocks", "interpret"))
def fused_linear_gpu(x, w, norm_w=None, bias=None, residual=None, *, prologue="none", eps=1e-6, out_dtype=None,
                     blocks=None, interpret=False, sumsq=None, next_norm_w=None, w_scale=None):
    """The kernel on one row, x: [1, K_in]. blocks: (block_f, block_d, num_warps,
    num_stages[, mma]), or None for one_row_blocks. w_scale f32[F]: an FP8 weight's. sumsq
    f32[1, n] / next_norm_w [F]: the RMSNorm hand-over (ref_fused_linear); with next_norm_w
    it returns (y, y * next_norm_w, f32[1, programs]), one partial sum per program. A sumsq
    whose n is not a power of two is zero-padded here (Triton loads power-of-two blocks)."""
    F, K = w.shape
    bf, bd, warps, stages, *mma = blocks or one_row_blocks(F, K, w.dtype, x.dtype)
    mma = bool(mma and mma[0])
    whole = pl.BlockSpec()
    sumsq = None if sumsq is None else pad_sumsq(sumsq)
    inputs = [x, w] + [a for a in (w_scale, norm_w, sumsq, bias, residual, next_norm_w) if a is not None]
    in_specs = [whole, pl.BlockSpec((bf, K), lambda i: (i, 0))] + [whole] * (len(inputs) - 2)
    dt = jnp.dtype(out_dtype or dot_dtype(x.dtype, w.dtype))
    out_shape = jax.ShapeDtypeStruct((1, F), dt)
    if next_norm_w is not None:
        out_shape = (out_shape, out_shape, jax.ShapeDtypeStruct((1, F // bf), jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, prologue=prologue, K=K, block_f=bf, block_d=bd, eps=eps,
                          has_scale=w_scale is not None, has_norm=norm_w is not None, has_sumsq=sumsq is not None,
                          has_bias=bias is not None, has_res=residual is not None, has_next=next_norm_w is not None, mma=mma),
        grid=(F // bf,),
        in_specs=in_specs,
        out_specs=(whole, whole, whole) if next_norm_w is not None else whole,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"fused_linear_{prologue}_f{bf}_d{bd}{'_mma' if mma else ''}{'_fp8' if w_scale is not None else ''}"
             f"{'_norm_out' if next_norm_w is not None else ''}",
    )(*inputs)


def supports(rows: int, w_shape) -> bool:
    """The kernel's contract: one row of x, and power-of-2 tiles that divide the [F, K]
    weight (default_blocks). Whether a model's projection is worth the kernel is decided
    elsewhere (jspec.ops.linear_kernel)."""
    return rows == 1 and default_blocks(*w_shape) is not None


def fused_linear(x, w, *, prologue="none", norm_w=None, eps=1e-6, bias=None, residual=None, out_dtype=None,
                 sumsq=None, next_norm_w=None, interpret=False, blocks=None, w_scale=None):
    """Public entry: the kernel (ref_fused_linear's arguments and results, [out, in] weights
    only; an FP8 one with its w_scale), on what ``supports`` says; ``interpret``: its body in
    Pallas' interpreter. With
    next_norm_w -> (y, y * next_norm_w, f32[..., n] partial sums of y^2). blocks: the
    kernel's tiles (fused_linear_gpu's; None: one_row_blocks), for tests of each weight
    stream at any shape."""
    validate(x, w, prologue, norm_w, bias, residual, out_dtype, sumsq, next_norm_w, w_scale=w_scale)
    rows = math.prod(x.shape[:-1])
    if sumsq is not None and prologue == "none":
        raise ValueError("fused_linear: the one-row kernel takes a handed-over sumsq with the silu_mul prologue only")
    if not supports(rows, w.shape):
        raise ValueError(f"fused_linear: the kernel takes one row and a weight its tiles divide, got {rows} rows "
                         f"and a {w.shape} weight")
    lead, F = x.shape[:-1], w.shape[0]
    out = fused_linear_gpu(
        x.reshape(1, x.shape[-1]), w, norm_w, bias, None if residual is None else residual.reshape(1, F),
        prologue=prologue, eps=float(eps), out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name,
        interpret=interpret, sumsq=None if sumsq is None else sumsq.reshape(1, sumsq.shape[-1]),
        next_norm_w=next_norm_w, blocks=blocks, w_scale=w_scale,
    )
    if next_norm_w is None:
        return out.reshape(lead + (F,))
    y, hn, ss = out
    return y.reshape(lead + (F,)), hn.reshape(lead + (F,)), ss.reshape(lead + ss.shape[-1:])
