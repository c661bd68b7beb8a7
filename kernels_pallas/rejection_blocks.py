"""The per-block statistics of rejection sampling (kernels_pallas/rejection_sampling.py):
the GPU kernels (Pallas, Triton backend; also the interpret=True bodies) and the TPU
kernels (Mosaic), with the row modes, block geometry and the maths they share with the
jnp reference.

Contract: for a logits row x [V] with per-row (draft d, mode, 1 / temperature, top-k/p
threshold), ``_stats_*`` returns per vocabulary block of ``sample_block(V)`` tokens the
greedy (max, lowest argmax) or sampled (max of z, sum exp, sum exp without the draft)
statistics; ``_resid_*`` the residual mass sum max(p - q, 0) of each block given the
row's global max and normaliser. f32 accumulation; results equal the reference's
(`_ref_block_stats`, `_ref_block_resid`) up to float summation order. The two-level draw
and the accept decisions that consume them are jnp, shared with the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.tuning import device_tuning

# Row modes (what row i of a request needs).
_PAD, _GREEDY, _BONUS, _RESIDUAL = 0, 1, 2, 3
_BIG = np.int32(2**31 - 1)
_NEG_INF = np.float32(-np.inf)
SAMPLE_BLOCK = 2048  # vocabulary block of the two-level draw (part of the sampling semantics)


def sample_block(v: int) -> int:
    """Block width for vocabulary size v: SAMPLE_BLOCK, or the largest power of two <= v."""
    return 1 << (min(v, SAMPLE_BLOCK).bit_length() - 1)


def num_blocks(v: int) -> int:
    return -(-v // sample_block(v))


def _greedy_math(x, col, valid):
    """Block max of the logits and its lowest column, reduced over the last axis (keepdims)."""
    gx = jnp.where(valid, x, _NEG_INF)
    g_max = jnp.max(gx, axis=-1, keepdims=True)
    return g_max, jnp.min(jnp.where(gx == g_max, col, _BIG), axis=-1, keepdims=True)


def _sampled_math(x, col, valid, d, inv_t, thr):
    """Block max of z, sum exp(z - max), the same without the draft (keepdims)."""
    z = jnp.where(valid & (x >= thr), x * inv_t, _NEG_INF)
    m_b = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(m_b == _NEG_INF, 0.0, m_b))
    s_b = jnp.sum(e, axis=-1, keepdims=True)
    return m_b, s_b, jnp.sum(jnp.where(col != d, e, 0.0), axis=-1, keepdims=True)


# ----------------------------------------------------------------------------------------
# Residual math of the kernel bodies: x f32[..., n] with per-row params broadcasting
# against it (scalars on GPU, [K, 1] columns on TPU).
# ----------------------------------------------------------------------------------------


def _resid_math(x, q, valid, inv_t, thr, m, s):
    z = jnp.where(valid & (x >= thr), x * inv_t, _NEG_INF)
    r = jnp.where(valid, jnp.maximum(jnp.exp(z - m) / s - q, 0.0), 0.0)
    return jnp.sum(r, axis=-1, keepdims=True)


def _poison_inputs(shapes_dtypes):
    """Sentinel-filled output buffers (aliased to the outputs) so tests see unwritten slots."""
    return [jnp.full(sh, -7 if dt == jnp.int32 else jnp.nan, dt) for sh, dt in shapes_dtypes]


# ----------------------------------------------------------------------------------------
# GPU kernels (Triton backend; also the interpret=True bodies): one program per (row,
# blocks_per_program consecutive vocabulary blocks; more than one is a fori_loop that
# Triton may pipeline with num_stages). On the H200 (2026-11-21, profiler GPU time, B=64,
# K=7, V=128256) one 2048-wide block per program with 2 warps was fastest: 56.2 us, 2.34
# TB/s, 51% of a bf16 row reduction timed the same way; 4 blocks per program 59.2 us,
# 1 warp 62.1 us, 4 warps 64.5 us. A [rows, 2048] tile per program (several rows of a
# request at once) was slower still (wall clock 110-187 us against 107 us).
# ----------------------------------------------------------------------------------------


def _align(v, bv):
    """Largest power of two (<= 16) dividing every block start: Triton then issues vector loads."""
    m = 16
    while m > 1 and ((v - bv) % m or bv % m):
        m //= 2
    return m


def _gpu_block(ref, j, v, bv):
    # The last block is shifted to end at V (no out-of-bounds loads); its columns already
    # covered by the previous block are masked out. Blocks past V (grid padding) are empty.
    # The min() hides the starts' alignment from Triton: restate it, or loads go scalar.
    start = pl.multiple_of(jnp.minimum(j * bv, v - bv), _align(v, bv))
    col = start + lax.broadcasted_iota(jnp.int32, (bv,), 0)
    return ref[pl.ds(start, bv)].astype(jnp.float32), col, col >= j * bv


def _for_blocks(g, bpp, body):
    """body(t, j) for the program's blocks t = 0..bpp-1 (vocabulary block j = g * bpp + t).
    g = pl.program_id(2), read at the kernel's top level (the interpreter does not
    substitute program ids inside a loop nested in a pl.when)."""
    if bpp == 1:
        body(0, g)
    else:
        lax.fori_loop(0, bpp, lambda t, c: (body(t, g * bpp + t), c)[1], 0)


def _gpu_stats_kernel(ip_ref, fp_ref, x_ref, *rest, v, bv, bpp, n_poison):
    # ip_ref i32[2] (d, mode), fp_ref f32[2] (inv_t, thr), x_ref [V] logits row,
    # [poisoned aliases, unread], outputs a, s, sx f32[bpp], gi i32[bpp].
    a_ref, s_ref, sx_ref, gi_ref = rest[n_poison:]
    d, mode = ip_ref[0], ip_ref[1]
    inv_t, thr = fp_ref[0], fp_ref[1]
    g = pl.program_id(2)
    zero, izero = jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.int32)

    def put(t, a, s, sx, gi):
        a_ref[pl.ds(t, 1)] = a
        s_ref[pl.ds(t, 1)] = s
        sx_ref[pl.ds(t, 1)] = sx
        gi_ref[pl.ds(t, 1)] = gi

    @pl.when(mode == _PAD)
    def _():  # all bpp slots at once (bpp is a power of two: a legal Triton shape)
        a_ref[...] = jnp.full((bpp,), _NEG_INF)
        s_ref[...] = jnp.zeros((bpp,), jnp.float32)
        sx_ref[...] = jnp.zeros((bpp,), jnp.float32)
        gi_ref[...] = jnp.zeros((bpp,), jnp.int32)

    @pl.when(mode == _GREEDY)
    def _():
        def body(t, j):
            x, col, valid = _gpu_block(x_ref, j, v, bv)
            g_max, g_idx = _greedy_math(x, col, valid)
            put(t, g_max, zero, zero, g_idx)
        _for_blocks(g, bpp, body)

    @pl.when(mode >= _BONUS)
    def _():
        def body(t, j):
            x, col, valid = _gpu_block(x_ref, j, v, bv)
            put(t, *_sampled_math(x, col, valid, d, inv_t, thr), izero)
        _for_blocks(g, bpp, body)


def _gpu_resid_kernel(ip_ref, fp_ref, x_ref, q_ref, *rest, v, bv, bpp, n_poison):
    # ip_ref i32[2] (d, mode), fp_ref f32[4] (inv_t, thr, m, s), x_ref / q_ref [V] rows,
    # [poisoned alias], output r f32[bpp].
    r_ref = rest[n_poison]
    mode = ip_ref[1]
    inv_t, thr, m, s = fp_ref[0], fp_ref[1], fp_ref[2], fp_ref[3]
    g = pl.program_id(2)

    @pl.when(mode != _RESIDUAL)
    def _():
        r_ref[...] = jnp.zeros((bpp,), jnp.float32)

    @pl.when(mode == _RESIDUAL)
    def _():
        def body(t, j):
            x, _, valid = _gpu_block(x_ref, j, v, bv)
            q, _, _ = _gpu_block(q_ref, j, v, bv)
            r_ref[pl.ds(t, 1)] = _resid_math(x, q, valid, inv_t, thr, m, s)
        _for_blocks(g, bpp, body)


def _gpu_call(kernel, row_args, out_dtypes, nrows, *, v, interpret, bpp, num_warps, num_stages,
              poison, name):
    """pallas_call over grid (B, nrows, padded blocks / bpp); row_args are [B, rows, n]
    parameter arrays and [B, rows', V] data arrays (row index clamped to the array's rows)."""
    b = row_args[0].shape[0]
    bv, nb = sample_block(v), num_blocks(v)
    ng = -(-nb // bpp)
    in_specs = []
    for arr in row_args:
        rows_a, width = arr.shape[1], arr.shape[2]
        in_specs.append(pl.BlockSpec((None, None, width),
                                     lambda bi, i, g, r=rows_a: (bi, jnp.minimum(i, r - 1), 0)))
    out_spec = pl.BlockSpec((None, None, bpp), lambda bi, i, g: (bi, i, g))
    shapes = [((b, nrows, ng * bpp), dt) for dt in out_dtypes]
    args, kwargs = list(row_args), {}
    if poison:
        in_specs += [out_spec] * len(shapes)
        args += _poison_inputs(shapes)
        kwargs["input_output_aliases"] = {len(row_args) + i: i for i in range(len(shapes))}
    if not interpret:
        from jax.experimental.pallas import triton as plt
        kwargs["compiler_params"] = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    outs = pl.pallas_call(
        functools.partial(kernel, v=v, bv=bv, bpp=bpp, n_poison=len(shapes) if poison else 0),
        grid=(b, nrows, ng),
        in_specs=in_specs,
        out_specs=[out_spec] * len(shapes),
        out_shape=[jax.ShapeDtypeStruct(sh, dt) for sh, dt in shapes],
        interpret=interpret,
        name=name,
        **kwargs,
    )(*args)
    return [o[..., :nb] for o in outs]


def _stats_gpu(x, d, mode, inv_t, thr, *, interpret, bpp=1, num_warps=2, num_stages=1, poison=False):
    b, k1, v = x.shape
    ip = jnp.stack([d, mode], axis=-1)
    fp = jnp.stack([inv_t, thr], axis=-1)
    f32, i32 = jnp.float32, jnp.int32
    return tuple(_gpu_call(_gpu_stats_kernel, [ip, fp, x], [f32, f32, f32, i32], k1, v=v,
                           interpret=interpret, bpp=bpp, num_warps=num_warps, num_stages=num_stages,
                           poison=poison, name="rejection_stats_gpu"))


def _resid_gpu(x, q, d, mode, inv_t, thr, m, s, *, interpret, bpp=1, num_warps=2, num_stages=1,
               poison=False):
    """x [B, K+1, V] (rows < K read), q [B, K, V]; params [B, K]."""
    b, k, v = q.shape
    ip = jnp.stack([d, mode], axis=-1)
    fp = jnp.stack([inv_t, thr, m, s], axis=-1)
    (r,) = _gpu_call(_gpu_resid_kernel, [ip, fp, x, q], [jnp.float32], k, v=v, interpret=interpret,
                     bpp=bpp, num_warps=num_warps, num_stages=num_stages, poison=poison,
                     name="rejection_resid_gpu")
    return r


# ----------------------------------------------------------------------------------------
# TPU kernels (Mosaic TPU): grid (B, blocks), one (rows, tile) tile per program.
# ----------------------------------------------------------------------------------------


def _tpu_tile(v):
    """(tile width, tile index is the block index). Blocks narrower than 128 lanes (V < 128)
    use one full-width tile (a full dim is always a legal block) and mask by column."""
    bv = sample_block(v)
    return (bv, True) if bv % 128 == 0 else (v, False)


def _tpu_cols(rows, v):
    bv = sample_block(v)
    tile, by_block = _tpu_tile(v)
    j = pl.program_id(1)
    col = (j * bv if by_block else 0) + lax.broadcasted_iota(jnp.int32, (rows, tile), 1)
    return col, (col >= j * bv) & (col < jnp.minimum((j + 1) * bv, v))


def _tpu_stats_kernel(ip_ref, fp_ref, x_ref, *rest, v, n_poison):
    # ip_ref i32[K+1, 2], fp_ref f32[K+1, 2], x_ref [K+1, tile], [poisoned aliases],
    # outputs a, s, sx f32[K+1, 1], gi i32[K+1, 1].
    a_ref, s_ref, sx_ref, gi_ref = rest[n_poison:]
    d, mode = ip_ref[:, 0:1], ip_ref[:, 1:2]
    inv_t, thr = fp_ref[:, 0:1], fp_ref[:, 1:2]
    col, valid = _tpu_cols(x_ref.shape[0], v)
    x = x_ref[...].astype(jnp.float32)
    g_max, g_idx = _greedy_math(x, col, valid)
    m_b, s_b, sx_b = _sampled_math(x, col, valid, d, inv_t, thr)
    greedy, sampled = mode == _GREEDY, mode >= _BONUS
    a_ref[...] = jnp.where(greedy, g_max, jnp.where(sampled, m_b, _NEG_INF))
    s_ref[...] = jnp.where(sampled, s_b, 0.0)
    sx_ref[...] = jnp.where(sampled, sx_b, 0.0)
    gi_ref[...] = jnp.where(greedy, g_idx, 0)


def _tpu_resid_kernel(ip_ref, fp_ref, x_ref, q_ref, *rest, v, n_poison):
    # ip_ref i32[K, 2], fp_ref f32[K, 4], x_ref [K+1, tile] (rows < K used), q_ref [K, tile].
    r_ref = rest[n_poison]
    k = q_ref.shape[0]
    mode = ip_ref[:, 1:2]
    inv_t, thr, m, s = (fp_ref[:, c:c + 1] for c in range(4))
    _, valid = _tpu_cols(k, v)
    x = x_ref[...].astype(jnp.float32)[0:k]
    r = _resid_math(x, q_ref[...].astype(jnp.float32), valid, inv_t, thr, m, s)
    r_ref[...] = jnp.where(mode == _RESIDUAL, r, 0.0)


def _tpu_call(kernel, params, data, out_dtypes, nrows, *, v, interpret, poison, name):
    from jax.experimental.pallas import tpu as pltpu

    b = params[0].shape[0]
    nb = num_blocks(v)
    tile, by_block = _tpu_tile(v)
    in_specs = [pl.BlockSpec((None,) + p.shape[1:], lambda bi, j: (bi, 0, 0)) for p in params]
    in_specs += [pl.BlockSpec((None, arr.shape[1], tile), lambda bi, j: (bi, 0, j if by_block else 0))
                 for arr in data]
    out_spec = pl.BlockSpec((None, None, nrows, 1), lambda bi, j: (bi, j, 0, 0))
    shapes = [((b, nb, nrows, 1), dt) for dt in out_dtypes]
    args = list(params) + list(data)
    aliases = {}
    if poison:
        in_specs += [out_spec] * len(shapes)
        aliases = {len(args) + i: i for i in range(len(shapes))}
        args += _poison_inputs(shapes)
    outs = pl.pallas_call(
        functools.partial(kernel, v=v, n_poison=len(shapes) if poison else 0),
        grid=(b, nb),
        in_specs=in_specs,
        out_specs=[out_spec] * len(shapes),
        out_shape=[jax.ShapeDtypeStruct(sh, dt) for sh, dt in shapes],
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*args)
    return [jnp.swapaxes(o[..., 0], 1, 2) for o in outs]  # -> [B, rows, NB]


def _stats_tpu(x, d, mode, inv_t, thr, *, interpret, poison=False):
    k1, v = x.shape[1], x.shape[2]
    ip = jnp.stack([d, mode], axis=-1)
    fp = jnp.stack([inv_t, thr], axis=-1)
    f32, i32 = jnp.float32, jnp.int32
    return tuple(_tpu_call(_tpu_stats_kernel, [ip, fp], [x], [f32, f32, f32, i32], k1, v=v,
                           interpret=interpret, poison=poison, name="rejection_stats_tpu"))


def _resid_tpu(x, q, d, mode, inv_t, thr, m, s, *, interpret, poison=False):
    k, v = q.shape[1], q.shape[2]
    ip = jnp.stack([d, mode], axis=-1)
    fp = jnp.stack([inv_t, thr, m, s], axis=-1)
    (r,) = _tpu_call(_tpu_resid_kernel, [ip, fp], [x, q], [jnp.float32], k, v=v,
                     interpret=interpret, poison=poison, name="rejection_resid_tpu")
    return r


@dataclasses.dataclass(frozen=True)
class BlockKernels:
    """One platform's per-block statistics kernels (``_stats_*`` and ``_resid_*`` above)
    with their static options; made by gpu_kernels / tpu_kernels. Hashable and compared by
    value: a static jit argument."""

    stats: Callable
    resid: Callable
    options: tuple = ()  # (name, value) pairs passed to both

    def block_stats(self, x, q, d, mode, inv_t, thr):
        """(the stats kernel's per-block statistics of x [B, K+1, V], resid(m, s): the
        residual kernel's of rows < K against q [B, K, V]), as rejection_sampling's
        _select takes them."""
        k, kw = x.shape[1] - 1, dict(self.options)

        def resid(m, s):
            return self.resid(x, q, d[:, :k], mode[:, :k], inv_t[:, :k], thr[:, :k], m, s, **kw)

        return self.stats(x, d, mode, inv_t, thr, **kw), resid


def gpu_kernels(*, interpret: bool = False, blocks_per_program: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> BlockKernels:
    """The Triton-backend kernels (``interpret``: their bodies in Pallas' interpreter). Tuning,
    None: the device's row (kernels_pallas/tuning.py; H200: 1, 2, 1): vocabulary blocks per
    program (a power of two: a loop), Triton warps per program, pipelining depth of the
    block loop. It changes speed only, never the tokens."""
    bpp, num_warps, num_stages = (d if a is None else a for a, d in zip(
        (blocks_per_program, num_warps, num_stages), device_tuning().rejection))
    if not isinstance(bpp, int) or bpp < 1 or bpp & (bpp - 1):
        raise ValueError(f"blocks_per_program must be a power of two >= 1, got {bpp!r}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    return BlockKernels(_stats_gpu, _resid_gpu, (("interpret", interpret), ("bpp", bpp), ("num_warps", num_warps),
                                                 ("num_stages", num_stages)))


def tpu_kernels(*, interpret: bool = False) -> BlockKernels:
    """The Mosaic TPU kernels (``interpret``: under pltpu.InterpretParams, on a CPU)."""
    return BlockKernels(_stats_tpu, _resid_tpu, (("interpret", interpret),))
