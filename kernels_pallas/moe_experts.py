"""Few-token mixture-of-experts: each (token, expert) pair's expert MLP, the expert's weights
streamed in place.

    y[p] = down_e(silu(g) * u),  g | u = gate_up_e(x[p // top_k]),  e = experts[p]

for the pairs p of tokens x [N, H] and their chosen experts (experts i32[N * top_k],
token-major); w_gate_up [E, 2I, H] and w_down [E, H, I] (HF's [out, in] per expert).
-> y [N * top_k, H]. The router before and each token's weighted sum of its top_k rows after
stay in XLA (jspec.ops.moe).

Why: as the pairs grow, XLA's gather-then-dot (the reference below) falls behind one weight
stream per pair. XLA does not copy the chosen experts first (it fuses the gather into its
reductions: 25.5 us of GPU time in the expert projections at 1 token, 2.96 TB/s, against
34.7 us here; docs/bench/2026-11-27_moe_layer_gpu_time_h100.log), but at 16 tokens its
projections took 353 us to these kernels' 298. Each program here reads its expert's rows in
place, one stream per (pair, row tile).

Kernels (Pallas, Triton backend), two calls, each a one-row weight stream per program
(fused_linear.stream_rows, its tiles from kernels_pallas/tuning.py):
  1. grid (pairs, I / block_f): the program reads experts[p] and streams its expert's
     block_f gate rows and the matching up rows against x[p // top_k]; silu(g) * u, rounded
     op by op like the reference -> act [P, I];
  2. grid (pairs, H / block_f): block_f rows of the expert's down against act[p] -> y.
Row offsets are int32 element offsets into the stacked weights: ``supports`` asks for fewer
than 2^31 elements.

Measured, one Qwen3-30B-A3B layer on an H100 (scripts/bench_moe_layer.py; raw
docs/bench/2026-11-27_moe_layer_kernels_h100.log), with tensor-core tiles, against XLA's
gather: 0.072 vs 0.058 ms at 1 token (8 pairs), 0.142 vs 0.140 at 4, 0.215 vs 0.230 at 8,
0.340 vs 0.421 at 16 (128 pairs). Slower at one token, faster as pairs grow (why, not
profiled further): jspec.ops.moe takes the kernels from E / 2 pairs. The experts' weights
are narrow ([768, 2048], [2048, 768]), so the tuning table gives them the elementwise
stream (2026-11-27): 0.230 / 0.344 ms at 8 / 16 tokens against 0.248 / 0.367 with the tensor-core tiles
(docs/bench/2026-11-27_moe_layer_tiles_h100.log).

Numerics: f32 accumulation, each projection rounded to the weights' dtype as XLA's dot
output is, then the SwiGLU product op by op: equal to the reference up to the order of the
f32 sums (tests/kernels/test_moe_experts.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import one_row_blocks, silu_mul_rounded, stream_rows


def swiglu(g, u, limit: float = 0.0, alpha: float = 1.702):
    """The experts' gated activation: silu(g) * u (Qwen3); with ``limit`` > 0 gpt-oss's
    clamped form (up.clip(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clip(max=limit)."""
    if not limit:
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, limit)
    return (jnp.clip(u, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))


def ref_moe_experts(x, experts, w_gate_up, w_down, *, top_k: int, b_gate_up=None, b_down=None, limit: float = 0.0,
                    alpha: float = 1.702):
    """The jnp reference (and the path on the CPU, the TPU and for many pairs): each pair's
    expert weights gathered, then applied. x [N, H]; experts i32[N * top_k] -> [N * top_k, H].
    gpt-oss: the experts' biases b_gate_up [E, 2I] and b_down [E, H], ``swiglu``'s limit and
    alpha (the kernels take neither: jspec.ops.moe does not send them there)."""
    validate(x, experts, w_gate_up, w_down, top_k)
    xs = jnp.repeat(x, top_k, axis=0)  # [P, H]: pair p is token p // top_k
    gu = jnp.einsum("mh,mih->mi", xs, w_gate_up[experts])
    if b_gate_up is not None:
        gu = gu + b_gate_up[experts]
    g, u = jnp.split(gu, 2, axis=-1)
    y = jnp.einsum("mi,mhi->mh", swiglu(g, u, limit, alpha), w_down[experts])
    return y if b_down is None else y + b_down[experts]


def combine_pairs(y, weights, *, residual=None):
    """Each token's weighted sum of its top_k rows: y [N * top_k, H] (pair p is token p // top_k),
    weights [N, top_k] -> [residual +] sum_j round(weights[n, j] * y[n top_k + j]), the products
    rounded to y's dtype (as XLA's multiply), summed in f32 in pair order, rounded; then the
    residual added in y's dtype. moe_experts_mxfp4's down kernel forms it in its epilogue."""
    N, top_k = weights.shape
    prod = y.reshape(N, top_k, -1) * weights.astype(y.dtype)[..., None]
    out = prod.astype(jnp.float32).sum(1).astype(y.dtype)
    return out if residual is None else residual + out


def supports(w_gate_up_shape, w_down_shape, dtype) -> bool:
    """The kernels' contract: tiles that divide [I, H] (gate and up halves) and [H, I], and
    stacked weights addressable with int32 element offsets."""
    E, I2, H = w_gate_up_shape
    return (I2 % 2 == 0 and tuple(w_down_shape) == (E, H, I2 // 2) and E * I2 * H < 2**31
            and one_row_blocks(I2 // 2, H, dtype) is not None and one_row_blocks(H, I2 // 2, dtype) is not None)


def _gate_up_kernel(idx_ref, x_ref, w_ref, o_ref, *, I, H, block_f, block_d, mma):
    # idx_ref i32[P] (whole), x_ref [1, H] (the pair's token), w_ref [E 2I, H] (whole),
    # o_ref [1, I] (the pair's row; this program writes block_f columns).
    p, j = pl.program_id(0), pl.program_id(1)
    row = idx_ref[p] * (2 * I) + j * block_f
    g, u = stream_rows(x_ref, [(w_ref, pl.ds(row, block_f)), (w_ref, pl.ds(row + I, block_f))], None,
                       prologue="none", K=H, block_d=block_d, eps=0.0, mma=mma)
    dt, f32 = o_ref.dtype, jnp.float32
    act = silu_mul_rounded(g.astype(dt).astype(f32), u.astype(dt).astype(f32), dt)
    o_ref[0, pl.ds(pl.multiple_of(j * block_f, block_f), block_f)] = act.astype(dt)


def _down_kernel(idx_ref, a_ref, w_ref, o_ref, *, H, I, block_f, block_d, mma):
    # idx_ref i32[P], a_ref [1, I] (the pair's activation), w_ref [E H, I] (whole), o_ref [1, H].
    p, j = pl.program_id(0), pl.program_id(1)
    row = idx_ref[p] * H + j * block_f
    (y,) = stream_rows(a_ref, [(w_ref, pl.ds(row, block_f))], None, prologue="none", K=I, block_d=block_d,
                       eps=0.0, mma=mma)
    o_ref[0, pl.ds(pl.multiple_of(j * block_f, block_f), block_f)] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("top_k", "interpret", "blocks"))
def moe_experts_gpu(x, experts, w_gate_up, w_down, *, top_k: int, interpret: bool = False, blocks=None):
    """The two kernels. x [N, H]; experts i32[N * top_k]; weights as in the contract.
    blocks: None (fused_linear's tiles for [I, H] and [H, I]) or a pair of (block_f,
    block_d, num_warps, num_stages, mma), gate_up's then down's (scripts/bench_moe_layer.py)."""
    (E, I2, H), P = w_gate_up.shape, experts.shape[0]
    I = I2 // 2
    whole = pl.BlockSpec()
    gate_up_blocks, down_blocks = blocks or (one_row_blocks(I, H, w_gate_up.dtype), one_row_blocks(H, I, w_down.dtype))
    bf, bd, warps, stages, mma = gate_up_blocks
    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, I=I, H=H, block_f=bf, block_d=bd, mma=mma),
        grid=(P, I // bf),
        in_specs=[whole, pl.BlockSpec((1, H), lambda p, j: (p // top_k, 0)), whole],
        out_specs=pl.BlockSpec((1, I), lambda p, j: (p, 0)),
        out_shape=jax.ShapeDtypeStruct((P, I), w_gate_up.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"moe_gate_up_f{bf}_d{bd}{'_mma' if mma else ''}",
    )(experts, x.astype(w_gate_up.dtype), w_gate_up.reshape(E * I2, H))
    bf, bd, warps, stages, mma = down_blocks
    return pl.pallas_call(
        functools.partial(_down_kernel, H=H, I=I, block_f=bf, block_d=bd, mma=mma),
        grid=(P, H // bf),
        in_specs=[whole, pl.BlockSpec((1, I), lambda p, j: (p, 0)), whole],
        out_specs=pl.BlockSpec((1, H), lambda p, j: (p, 0)),
        out_shape=jax.ShapeDtypeStruct((P, H), w_down.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"moe_down_f{bf}_d{bd}{'_mma' if mma else ''}",
    )(experts, act, w_down.reshape(E * H, I))


def validate(x, experts, w_gate_up, w_down, top_k: int):
    """The shapes: x [N, H], experts [N * top_k], w_gate_up [E, 2I, H], w_down [E, H, I]."""
    N, H = x.shape
    E, I2, Hw = w_gate_up.shape
    if Hw != H or tuple(w_down.shape) != (E, H, I2 // 2) or experts.shape != (N * top_k,):
        raise ValueError(f"moe_experts: x {x.shape}, experts {experts.shape} (top_k {top_k}), w_gate_up "
                         f"{w_gate_up.shape} and w_down {w_down.shape} do not fit [N, H], [N top_k], [E, 2I, H], "
                         f"[E, H, I]")


def moe_experts(x, experts, w_gate_up, w_down, *, top_k: int, interpret: bool = False):
    """Public entry: the kernels (ref_moe_experts' arguments and result), on what ``supports``
    says; ``interpret``: their bodies in Pallas' interpreter. x [N, H]; experts i32[N * top_k]."""
    validate(x, experts, w_gate_up, w_down, top_k)
    if not supports(w_gate_up.shape, w_down.shape, w_gate_up.dtype):
        raise ValueError(f"moe_experts: no kernel tile divides w_gate_up {w_gate_up.shape} / w_down {w_down.shape}")
    return moe_experts_gpu(x, experts.astype(jnp.int32), w_gate_up, w_down, top_k=top_k,
                           interpret=interpret)
