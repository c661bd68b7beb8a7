"""The ops facade: the one place that decides which kernels a model runs.

Model code (jspec/models, jspec/drafters) states the maths and calls these functions with a
``KernelPlan``; each function picks the kernel or the XLA ops for the call's static shapes.
The plan is made once per engine by ``plan_kernels`` from the backend, the model config and
the requested impls (EngineConfig.attn_impl / linear_impl / sample_impl), and is a static
attribute of the modules, so every decision is fixed at trace time.

Where kernels run (with the GPU plan):
- paged attention: the Pallas kernel for the plan's backend at every shape (``attention``);
- batch-1 decode glue: at one row (one decode token) the RMSNorms, SwiGLU, bias and
  residual adds ride along with the projections' weight stream (kernels_pallas/
  fused_linear.py), RoPE and the KV write run in one kernel (rope_kv_write.py), and for
  models without qk-norm the input norm, qkv, RoPE and the KV write are one kernel
  (qkv_rope_kv_write.py);
- verification glue: at 2-16 rows (a batch-1 verification step's K + 1 tokens) the
  projections run fused_linear_rows.py, each norm handed over by the projection before it
  (o_proj -> gate_up, down_proj -> the next layer's qkv), gate_up with SwiGLU in its
  epilogue, the residual adds in o_proj's and down_proj's; RoPE and the KV write as above.
  More rows (prefill, larger batches) run the XLA ops, where a GEMM, not launch count,
  dominates;
- rejection sampling (``rejection_sample``): the plan's ``sample`` backend's block kernels.
FP8 weights (``jspec.quantization.QuantWeight``: weight-only, a quantized checkpoint's or
quantization="fp8"): a per-channel or per-tensor one takes the paths above, the kernels
streaming its FP8 bytes with its scale on each dot's f32 result (the kernels' ``w_scale``),
XLA's dot elsewhere entering it as its FP8 values (XLA fuses that conversion into the GEMM,
which then streams a byte a weight), or, under the plan's ``fp8_gemm`` beyond
FP8_GEMM_MIN_ROWS bf16 / f16 rows, with the activations quantized per token too (W8A8 on
FP8 tensor cores); a block-scaled one takes XLA's dots (``_fp8_plan``): its
row blocks' dots up to FP8_BLOCK_DOT_ROWS rows (``_fp8_block_dot``), dequantized first beyond.
Each kernel file holds its jnp reference and its kernels' entries; the plan's typed backends
(jspec/kernel_backend.py: XLA(), GPU(interpret), TPU(interpret)) pick among them here and in
jspec/ops_attention.py (attention) and jspec/ops_moe.py (mixture-of-experts layers). A shape a kernel cannot tile runs the XLA path with one log line
(kernel_backend.shape_fallback).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from jspec.kernel_backend import GPU, TPU, XLA, Backend, shape_fallback  # noqa: F401 (ops.GPU, ... for callers)
from jspec.kernel_plan import (  # noqa: F401 (the facade's names: model code reads the plan as ops.KernelPlan)
    FP8_GEMM_MIN_ROWS,
    MAX_KERNEL_FEATURES,
    KernelPlan,
    _linear_kernel_takes,
    _norm_handoff,
    plan_kernels,
    plan_params,
    vocab_rows,
    weight_shape,
)
from jspec.ops_attention import _KV_HEADS, attention  # noqa: F401 (re-exported: ops.attention)
from jspec.ops_moe import MOE_DENSE_CHUNK, MOE_KERNEL_MIN_FRACTION, moe  # noqa: F401 (re-exported: ops.moe)
from jspec.parallel.mesh import TP_AXIS
from jspec.quantization import QuantWeight
from kernels_pallas import fused_linear as _fl
from kernels_pallas import fused_linear_rows as _flr
from kernels_pallas import fused_linear_split_k as _flk
from kernels_pallas import paged_attention as _pa
from kernels_pallas import qkv_rope_kv_write as _qkv
from kernels_pallas import rejection_sampling as _rs
from kernels_pallas import rope_kv_write as _rope
from kernels_pallas.fused_linear import rms_norm

# Whether 2-16-row projections take fused_linear_rows' kernel (linear_kernel); scripts A/B it.
ROWS_KERNEL = True


@struct.dataclass
class Normed:
    """rms_norm(x, weight, eps), not applied yet: the projection it feeds applies it (inside
    its kernel where one runs). ``value()`` applies it. Handed over by the previous
    projection's kernel (linear_then_norm), it also carries x * weight and f32[..., n]
    partial sums of x^2, from which ``mlp`` forms the norm without an op of its own."""

    x: jax.Array  # [..., D] the un-normed input (the residual stream)
    weight: jax.Array  # [D]
    eps: float = struct.field(pytree_node=False)
    scaled: jax.Array | None = None  # [..., D] x * weight, un-normalised (handed over)
    sumsq: jax.Array | None = None  # f32[..., n]: sum over n = sum(x^2) (handed over)

    @property
    def shape(self):
        return self.x.shape

    def value(self):
        return rms_norm(self.x, self.weight, self.eps)


# ---- decisions (static shapes) ---------------------------------------------------------
def _stored_dtype(w):
    """The dtype a weight streams in: an FP8 QuantWeight's float8 (its ``dtype`` is the
    compute dtype), the tile tables' and the kernels' contracts' key."""
    return w.w.dtype if isinstance(w, QuantWeight) else w.dtype


def _kernel_weight(w):
    """(the array a kernel or reference streams, its per-channel scale f32[F] | None): a
    per-channel FP8 QuantWeight's FP8 values and scale, any other weight as it is."""
    return (w.w, w.scale.reshape(-1)) if isinstance(w, QuantWeight) else (w, None)


def _fused_linear(plan: KernelPlan, x, w, *, kernel: bool, prologue="none", norm_w=None, **kw):
    """With ``kernel`` (linear_kernel said yes: the plan's GPU kernels) fused_linear's kernel
    (one row; split over K where the device lists the shape: fused_linear_split_k) or
    fused_linear_rows' (2-16 rows, no prologue), else the reference. w may be a per-channel
    FP8 QuantWeight."""
    w, kw["w_scale"] = _kernel_weight(w)
    if not kernel:
        x_fp8 = (plan.fp8_gemm and kw["w_scale"] is not None and _rows(x) > FP8_GEMM_MIN_ROWS
                 and x.dtype in (jnp.bfloat16, jnp.float16))
        return _fl.ref_fused_linear(x, w, prologue=prologue, norm_w=norm_w, x_fp8=x_fp8, **kw)
    if _rows(x) > 1:
        return _flr.fused_linear_rows(x, w, interpret=plan.linear.interpret, **kw)
    if prologue != "rmsnorm" and kw.get("next_norm_w") is None and _flk.split_k_blocks(*w.shape, w.dtype, x.dtype):
        return _flk.fused_linear_split_k(x, w, prologue=prologue, interpret=plan.linear.interpret, **kw)
    return _fl.fused_linear(x, w, prologue=prologue, norm_w=norm_w, interpret=plan.linear.interpret, **kw)


def linear_kernel(plan: KernelPlan, rows: int, w_shape, *, fused: bool, dtype=None, prologue: str = "none") -> bool:
    """Whether a projection runs a fused kernel: the plan's GPU kernels, something to fuse
    (``fused``: a norm, SwiGLU, residual or norm hand-over; a bare GEMV is as fast through
    XLA), at most MAX_KERNEL_FEATURES outputs, and either one row (batch-1 decode:
    fused_linear's kernel) or 2 to 16 rows of a ``dtype`` weight with no prologue
    (fused_linear_rows' kernel: a verification step's K + 1 rows; more rows are a GEMM,
    faster through XLA, and its in-kernel RMSNorm or SwiGLU was slower than XLA's: see there).
    Besides, one row of an FP8 weight whose float16 tensor-core tile the device has
    (kernels_pallas/tuning.py ``linear_fp8_mma``: the 8B's gate_up, the 70B's gate_up and o),
    fused or not: XLA's dot converts the weight through f32 (the 8B's gate_up 42 us against
    the kernel's 30.5 on the H200)."""
    if not isinstance(plan.linear, GPU):
        return False
    if rows == 1 and dtype is not None and _pa.is_fp8(dtype) and _fl.default_mma_blocks(*w_shape, dtype):
        return True
    if not (fused and w_shape[0] <= MAX_KERNEL_FEATURES):
        return False
    if rows == 1:
        return _fl.supports(1, w_shape)
    return ROWS_KERNEL and prologue == "none" and dtype is not None and _flr.supports(rows, w_shape, dtype)


def qkv_kernel(plan: KernelPlan, rows: int, w_shape, head_dim: int, dtype) -> bool:
    """Whether norm + qkv + RoPE + KV write run as one kernel (for an input norm and no
    qk-norm): the plan's GPU kernels, one token, a head the projection's tile splits."""
    return isinstance(plan.linear, GPU) and _qkv.supports(rows, w_shape, head_dim, dtype)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _fp8_plan(plan: KernelPlan, *ws) -> KernelPlan | None:
    """For a call with block-scaled FP8 weights (QuantWeight with a block): the plan with its
    glue kernels off (XLA's dots); None for a call without (per-channel FP8 weights take the
    kernels). Decided by the weights' Python type at trace time, so an unquantized call is
    traced exactly as without quantization support."""
    if not any(isinstance(w, QuantWeight) and w.block is not None for w in ws):
        return None
    return dataclasses.replace(plan, linear=XLA(), norm_handoff=False)


# Rows up to which a block-scaled FP8 weight's dot takes _fp8_block_dot (more: dequantized first)
FP8_BLOCK_DOT_ROWS = 16


def _fp8_block_linear(plan: KernelPlan, x, w: QuantWeight, b, *, residual, out_dtype, out_in):
    """``linear`` of a block-scaled FP8 weight. (A per-channel one takes ``linear``'s paths:
    (x @ w.T in float32) * scale, the weight entering the dot as its FP8 values, exact in bf16
    and f32, so XLA fuses their conversion into the GEMM: on the H200 (jax 0.11.2, 2026-11-29,
    scripts/bench_fp8_linear.py) gate_up [28672, 4096] at 1 / 16 rows took 40.1 / 35.4 us of
    GPU time this way, 202 us dequantized first, 55-57 us in bf16; at 256 rows 125 us, slower
    than bf16's 98: no FP8 tensor cores.) A block scale varies along the dot's sum: up to
    FP8_BLOCK_DOT_ROWS rows _fp8_block_dot (50.3 / 65.5 us there), else dequantized first;
    then rounded, bias and residual added as the unquantized path does."""
    dt = jnp.dtype(w.dtype)
    if _rows(x) > FP8_BLOCK_DOT_ROWS or plan.in_out_weights or out_in or w.shape[0] % w.block[0]:
        return linear(plan, x, w.dequantize(), b, residual=residual, out_dtype=out_dtype, out_in=out_in)
    x = x.value() if isinstance(x, Normed) else x
    y = _fp8_block_dot(x.astype(dt), w).astype(out_dtype or dt)
    if b is not None:
        y = y + b
    return y if residual is None else residual + y


def _fp8_block_dot(x, w: QuantWeight):
    """x @ dequantize(w).T in float32 for an [F, K] weight of [b0, b1] block scales (F a
    multiple of b0): each of the F / b0 row blocks is a dot of x scaled by that block's
    scales (per b1 columns, rounded to x's dtype) with its FP8 rows as they are, so the
    weight streams once at a byte an element and only x, F / b0 times over, is written:
    x [..., K] -> f32[..., F]."""
    (b0, b1), (F, K) = w.block, w.shape
    lead = x.shape[:-1]
    xs = x.reshape(-1, K)  # [M, K]
    s = jnp.repeat(w.scale, b1, axis=-1)[:, :K]  # [F / b0, K]: each row block's scale per column
    xb = (xs[None].astype(jnp.float32) * s[:, None, :]).astype(x.dtype)  # [F / b0, M, K]
    wb = w.w.reshape(F // b0, b0, K).astype(x.dtype)
    y = jnp.einsum("gmk,gfk->mgf", xb, wb, preferred_element_type=jnp.float32)  # [M, F / b0, b0]
    return y.reshape(lead + (F,))


def _project(plan, x, w, b, *, prologue="none", norm_w=None, eps=1e-6, residual=None, out_dtype=None, sumsq=None,
             out_in=False, next_norm_w=None):
    # An [in, out] weight goes to the reference as is: a transpose back to [out, in] (or of
    # an [out, in] table to [in, out]) made XLA:CPU copy the lm_head into a loop fusion at
    # one row, 9 ms per decode step of the family.
    in_out = plan.in_out_weights and not out_in
    fused = prologue != "none" or residual is not None or sumsq is not None or next_norm_w is not None
    kernel = not in_out and linear_kernel(plan, _rows(x), w.shape, fused=fused, dtype=_stored_dtype(w),
                                          prologue=prologue)
    kw = dict(w_in_out=True) if in_out else {}
    return _fused_linear(plan, x, w, kernel=kernel, prologue=prologue, norm_w=norm_w, eps=eps, bias=b,
                         residual=residual, out_dtype=out_dtype, sumsq=sumsq, next_norm_w=next_norm_w, **kw)


# ---- the ops ---------------------------------------------------------------------------
def linear(plan: KernelPlan, x, w, b=None, *, residual=None, out_dtype=None, out_in=False):
    """[residual +] x @ w.T [+ b]. x: f[..., K] or Normed; w: [F, K] (HF layout; [K, F] with
    plan.in_out_weights, as every weight the ops take, unless ``out_in``: an embedding table
    read as a tied lm_head) or a QuantWeight of that shape; b: [F]; residual: [..., F];
    out_dtype: None (w.dtype) or float32 (logits). -> [..., F]"""
    if isinstance(w, QuantWeight) and w.block is not None:
        return _fp8_block_linear(_fp8_plan(plan, w), x, w, b, residual=residual, out_dtype=out_dtype, out_in=out_in)
    if isinstance(x, Normed) and x.sumsq is not None and _rows(x) > 1 and linear_kernel(
            plan, _rows(x), w.shape, fused=True, dtype=_stored_dtype(w)):
        # handed over (mlp's next_norm): fused_linear_rows scales x * weight by each row's 1 / rms
        return _fused_linear(plan, x.scaled, w, kernel=True, eps=x.eps, bias=b, residual=residual,
                             out_dtype=out_dtype, sumsq=x.sumsq)
    if isinstance(x, Normed):
        return _project(plan, x.x, w, b, prologue="rmsnorm", norm_w=x.weight, eps=x.eps, residual=residual,
                        out_dtype=out_dtype, out_in=out_in)
    return _project(plan, x, w, b, residual=residual, out_dtype=out_dtype, out_in=out_in)


def logits(plan: KernelPlan, h, w, *, vocab_size: int, out_in=False):
    """The lm_head: f32[..., vocab_size] = h @ w.T over w [Vp, H] ([H, Vp] under
    in_out_weights; ``out_in``: a tied embedding table, as ``linear``), whose rows may be
    padded past vocab_size under tensor parallelism (vocab_rows). The padded columns are
    sliced off here, so every consumer (the processors, structured-output masks, samplers,
    logprobs, a drafter's picks) sees the real vocabulary alone and never draws a padded id.
    The dot stays split by vocabulary on the devices; the slice drops the padding of the
    last device's block (no weight or logit gather; the sampler's reductions over the uneven
    blocks add a few collectives of a value per row: docs/architecture.md)."""
    y = linear(plan, h, w, out_dtype=jnp.float32, out_in=out_in)
    return y if y.shape[-1] == vocab_size else y[..., :vocab_size]


def linear_then_norm(plan: KernelPlan, x, w, b=None, *, residual, norm_w, eps) -> Normed:
    """h = residual + x @ w.T [+ b], returned as Normed(h, norm_w, eps): the next RMSNorm,
    for ``mlp``. With the plan's norm_handoff, at one row, the kernel also writes h * norm_w
    and per-program sums of h^2: XLA's gate_up GEMM reads h * norm_w as is and down_proj's
    kernel scales gate|up by 1 / rms, so the norm's two XLA fusions before gate_up go away:
    2.26 us per layer on the H200 (jax 0.11.2, 2026-11-22, explore_balance.py in git
    history, commit 4e58a84: gate_up 57.94 us with them, 55.68 without), against +0.36 us in
    o_proj's kernel and +1.0-1.2 in down's (commit 5527950). In the engine's decode step
    (bench.py, batch 1, ctx 512, three interleaved pairs): 4.15-4.17 ms per token with it,
    4.18-4.22 without."""
    plan = _fp8_plan(plan, w) or plan
    if plan.norm_handoff and linear_kernel(plan, _rows(x), w.shape, fused=True, dtype=_stored_dtype(w)):
        h, scaled, sumsq = _fused_linear(plan, x, w, kernel=True, bias=b, residual=residual, next_norm_w=norm_w)
        return Normed(h, norm_w, eps, scaled, sumsq)
    return Normed(linear(plan, x, w, b, residual=residual), norm_w, eps)


def split_fused(plan: KernelPlan, y, sizes):
    """The parts [..., n] of a fused projection's output y [..., sum(sizes)] (q|k|v, gate|up,
    DFlash's k|v). Under tensor parallelism the fused weight is tp-interleaved
    (jspec/parallel/placement.py): y is [part 0 | part 1 | ...] per device, each part's
    columns of that device, so the parts are gathered back from tp blocks, locally."""
    tp, lead = plan.tp, y.shape[:-1]
    if tp == 1:
        return [y[..., o: o + n] for o, n in zip(itertools.accumulate((0,) + tuple(sizes)), sizes)]
    per = [n // tp for n in sizes]
    y = y.reshape(lead + (tp, sum(per)))
    return [y[..., o: o + p].reshape(lead + (n,)) for o, p, n in zip(itertools.accumulate([0] + per), per, sizes)]


def mlp(plan: KernelPlan, x, w_gate_up, b_gate_up, w_down, b_down, *, residual=None, out_dtype=None,
        next_norm=None):
    """SwiGLU: [residual +] down(silu(g) * u) with g|u = gate_up(x). x: f[..., H] or
    Normed; w_gate_up: [2I, H]; w_down: [H, I]; biases [2I] / [H] | None; out_dtype: None
    (the weights') or float32 (a per-shard layer's partial sums). next_norm: (weight [H],
    eps) of the RMSNorm after this MLP (the next layer's input norm): where down_proj runs
    fused_linear_rows' kernel (2-16 rows), it hands that norm over and the result comes as
    Normed (for ``linear``); elsewhere a plain array. Either weight may be a QuantWeight."""
    if (fp8 := _fp8_plan(plan, w_gate_up, w_down)) is not None:  # XLA's dots, each weight through linear
        if isinstance(x, Normed) and x.sumsq is not None:  # (an unquantized layer's hand-over before)
            x = Normed(x.x, x.weight, x.eps)
        gu = linear(fp8, x, w_gate_up, b_gate_up)
        g, u = split_fused(fp8, gu, (gu.shape[-1] // 2,) * 2)
        return linear(fp8, jax.nn.silu(g) * u, w_down, b_down, residual=residual, out_dtype=out_dtype)
    if plan.tp > 1:  # gate|up tp-interleaved: g and u split per device, down's input sharded likewise
        gu = linear(plan, x, w_gate_up, b_gate_up)
        g, u = split_fused(plan, gu, (gu.shape[-1] // 2,) * 2)
        return linear(plan, jax.nn.silu(g) * u, w_down, b_down, residual=residual)
    rows = _rows(x)
    if (rows > 1 and out_dtype is None and residual is not None
            and linear_kernel(plan, rows, w_down.shape, fused=True, dtype=_stored_dtype(w_down))):
        # Verification rows (fused_linear_rows): gate_up on the handed-over norm with SwiGLU
        # in its epilogue (else XLA's GEMM and SwiGLU), then down_proj + residual [+ the next
        # norm's hand-over]. SwiGLU as down_proj's prologue recomputed it in every program.
        if isinstance(x, Normed) and x.sumsq is not None and b_gate_up is None and _flr.supports(
                rows, w_gate_up.shape, _stored_dtype(w_gate_up), swiglu=True):
            w, scale = _kernel_weight(w_gate_up)
            a = _flr.fused_linear_rows(x.scaled, w, sumsq=x.sumsq, eps=x.eps, swiglu=True,
                                       interpret=plan.linear.interpret, w_scale=scale)
        else:
            a = _fl.silu_mul(linear(plan, x, w_gate_up, b_gate_up))
        if next_norm is None:
            return _fused_linear(plan, a, w_down, kernel=True, bias=b_down, residual=residual)
        y, scaled, sumsq = _fused_linear(plan, a, w_down, kernel=True, bias=b_down, residual=residual,
                                         next_norm_w=next_norm[0])
        return Normed(y, next_norm[0], next_norm[1], scaled, sumsq)
    if isinstance(x, Normed) and x.sumsq is not None:  # handed over: see linear_then_norm
        gu = linear(plan, x.scaled, w_gate_up, b_gate_up)
        return _project(plan, gu, w_down, b_down, prologue="silu_mul", sumsq=x.sumsq, eps=x.eps, residual=residual,
                        out_dtype=out_dtype)
    gu = linear(plan, x, w_gate_up, b_gate_up)
    return _project(plan, gu, w_down, b_down, prologue="silu_mul", residual=residual, out_dtype=out_dtype)


def qkv_rope_write(plan: KernelPlan, x, w, b, rope, slot_mapping, k_pages, v_pages, q_norm_w=None, k_norm_w=None,
                   *, num_heads: int, eps: float):
    """Attention's inputs: q, k, v = split(x @ w.T [+ b]) -> per-head RMSNorm (Qwen3's q_norm
    / k_norm, eps) -> rotate-half RoPE; k and v written into the paged cache at their slots.
    x: f[B, Q, K] or Normed; w: [(H + 2 KVH) D, K]; b: [(H + 2 KVH) D] | None; rope: (cos,
    sin) f32[B, Q, D/2]; slot_mapping: i32[B, Q] (P * S: not written); k_pages, v_pages:
    [P, S, KVH, D]; q_norm_w, k_norm_w: [D] | None. w may be a QuantWeight.
    -> (q [B, Q, H, D], k_pages, v_pages)"""
    plan = _fp8_plan(plan, w) or plan
    B, Q, _ = x.shape
    M, D = B * Q, k_pages.shape[-1]
    (cos, sin), rows = rope, lambda a: a.reshape(M, -1)
    if plan.tp > 1:  # XLA ops over the tp-interleaved q|k|v (split_fused); the partitioner splits them
        KVH = k_pages.shape[2]
        q, k, v = split_fused(plan, rows(linear(plan, x, w, b)), (num_heads * D, KVH * D, KVH * D))
        q, k, v = q.reshape(M, num_heads, D), k.reshape(M, KVH, D), v.reshape(M, KVH, D)
        if q_norm_w is not None:
            q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
        q, k = _rope.rope_halves(q, rows(cos), rows(sin)), _rope.rope_halves(k, rows(cos), rows(sin))
        k_pages, v_pages = _pa.write_kv(k_pages, v_pages, k, v, slot_mapping.reshape(M))
        return q.reshape(B, Q, num_heads, D), k_pages, v_pages
    if isinstance(x, Normed) and q_norm_w is None and qkv_kernel(plan, M, w.shape, D, _stored_dtype(w)):
        w, scale = _kernel_weight(w)
        q, k_pages, v_pages = _qkv.qkv_rope_kv_write(rows(x.x), w, x.weight, b, rows(cos), rows(sin),
                                                     slot_mapping.reshape(M), k_pages, v_pages, num_heads=num_heads,
                                                     eps=x.eps, interpret=plan.linear.interpret, w_scale=scale)
        return q.reshape(B, Q, num_heads, D), k_pages, v_pages
    return rope_kv_write(plan, linear(plan, x, w, b), rope, slot_mapping, k_pages, v_pages, q_norm_w, k_norm_w,
                         num_heads=num_heads, eps=eps)


def rope_kv_write(plan: KernelPlan, qkv, rope, slot_mapping, k_pages, v_pages, q_norm_w=None, k_norm_w=None, *,
                  num_heads: int, eps: float):
    """After a qkv projection: per-head RMSNorm (q_norm / k_norm, eps), RoPE, and k, v
    written into the paged cache: kernels_pallas/rope_kv_write.py with the plan's GPU kernels
    (one kernel, the caches updated in place), else its reference. qkv: [B, Q, (H + 2 KVH) D]
    (num_heads H = 0: k and v only); rope: (cos, sin) f32[B, Q, D/2]; slot_mapping i32[B, Q].
    -> (q [B, Q, H, D], k_pages, v_pages)"""
    B, Q, _ = qkv.shape
    M, D = B * Q, k_pages.shape[-1]
    (cos, sin), rows = rope, lambda a: a.reshape(M, -1)
    args = (rows(qkv), rows(cos), rows(sin), slot_mapping.reshape(M), k_pages, v_pages, q_norm_w, k_norm_w)
    backend = XLA()  # the kernel is a GPU one
    if isinstance(plan.linear, GPU):
        backend = shape_fallback("rope_kv_write", plan.linear, _rope.unsupported_shape(D))
    match backend:
        case GPU(interpret=interpret):
            q, k_pages, v_pages = _rope.rope_kv_write(*args, num_heads=num_heads, eps=eps, interpret=interpret)
        case _:
            q, k_pages, v_pages = _rope.ref_rope_kv_write(*args, num_heads=num_heads, eps=eps)
    return q.reshape(B, Q, num_heads, D), k_pages, v_pages


def embed(plan: KernelPlan, table, tokens, *, shards: int):
    """table[tokens]: table [V, H] whose rows are split over ``shards`` devices of plan.mesh
    (1: whole on every device), tokens i32[...] -> [..., H]. Ids outside [0, V) are clipped
    (padding slots may carry any id). Split: each device gathers the rows it holds (zeros
    for the others' ids) and one all-reduce adds them up, exactly. Through XLA's
    partitioner the gather all-gathered the whole table instead: 1.98 ms per tp-2 8B
    decode step on the H200, a third of the step."""
    if shards == 1 or plan.mesh is None:
        return jnp.take(table, tokens, axis=0, mode="clip")
    def local(rows, ids):
        n = rows.shape[0]
        i = jnp.clip(ids, 0, n * shards - 1) - jax.lax.axis_index(TP_AXIS) * n
        mine = (i >= 0) & (i < n)
        x = jnp.take(rows, jnp.where(mine, i, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)), TP_AXIS)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(P(TP_AXIS, None), P()), out_specs=P(),
                         check_vma=False)(table, tokens)


def rejection_sample(plan: KernelPlan, target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
                     top_p, seeds, positions, *, method: str = "standard", synthetic_rates=None,
                     filtering: str = "auto"):
    """Speculative verification (and, with no drafts, plain sampling) on the plan's ``sample``
    backend: kernels_pallas/rejection_sampling.py's contract (target_logits f[B, K+1, V],
    draft_tokens i32[B, K], num_draft i32[B], draft_probs f32[B, K, V] | None, the
    per-row sampling params [B], method "standard" | "synthetic" with synthetic_rates
    f32[K], filtering "auto" | "off" | "on") -> (tokens i32[B, K+1] padded with -1,
    num_emitted i32[B]). The GPU / TPU block kernels at the device's tuning, or the jnp
    path (XLA)."""
    match plan.sample:
        case GPU(interpret=interpret):
            kernels = _rs.gpu_kernels(interpret=interpret)
        case TPU(interpret=interpret):
            kernels = _rs.tpu_kernels(interpret=interpret)
        case _:
            kernels = None
    return _rs.rejection_sample(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p, seeds,
                                positions, method=method, synthetic_rates=synthetic_rates, kernels=kernels,
                                filtering=filtering)


# ---- decoder layers once per device (tensor parallelism) -------------------------------
def layer_per_shard(plan: KernelPlan, num_kv_heads: int) -> bool:
    """Whether a decoder layer runs once per device (per_shard_layer): tensor parallelism
    whose size divides the KV heads, so each device attends over its own cache heads. A
    replicated cache (tp a multiple of the KV heads) keeps XLA's partitioned layer.

    Why: through XLA's SPMD partitioner a batch-1 8B layer at tp 2 ran ~17 kernels, its
    projections on XLA's GEMMs (3.45 ms per step against 2.79, half of tp 1's fused
    kernels) and 564 kernels per step, launch-bound (H100, docs/benchmarks.md "Tensor
    parallelism"). Per shard, a device runs tp 1's kernels on its slices of the weights."""
    return plan.tp > 1 and plan.mesh is not None and num_kv_heads % plan.tp == 0


def shard_plan(plan: KernelPlan) -> KernelPlan:
    """The plan one device runs inside a per-shard layer: its own weights and cache heads,
    no mesh, the glue kernels back (shard_linear). No RMSNorm hand-over: o_proj's output is
    a partial sum until the all-reduce."""
    return dataclasses.replace(plan, tp=1, mesh=None, linear=plan.shard_linear, norm_handoff=False)


def weight_partition(plan: KernelPlan, split: str | None, ndim: int):
    """A projection leaf's PartitionSpec on the "tp" axis: ``split`` "out" (column
    parallel: q|k|v, gate|up, their biases), "in" (row parallel: o_proj, down_proj) or None
    (replicated), in the plan's weight layout (weight_shape)."""
    if split is None:
        return P()
    if ndim == 1:
        return P(TP_AXIS)
    out_axis = 1 if plan.in_out_weights else 0
    axes = [None, None]
    axes[out_axis if split == "out" else 1 - out_axis] = TP_AXIS
    return P(*axes)


def _quant_partition(plan: KernelPlan, split: str | None, w: QuantWeight) -> QuantWeight:
    """An FP8 leaf's PartitionSpecs (a QuantWeight of them): the weight's, and its scale's:
    the same, except a row-parallel leaf's per-channel scale, which is replicated
    (jspec/parallel/placement.py)."""
    spec = weight_partition(plan, split, w.ndim)
    scale = P() if split == "in" and w.block is None else spec
    return QuantWeight(spec, scale, w.block, w.dtype)


def partial_linear(plan: KernelPlan, x, w):
    """One device's part of a row-parallel projection (o_proj in a per-shard layer): f32
    partial sums x @ w.T for ``reduce_add``. Nothing to fuse, yet one row takes the one-row
    kernel: on 2 x H200 (jax 0.11.2, 2026-12-01, bench_tp --procs --profile, batch 1) the 70B's
    shard [8192, 4096] took 18.7 us a layer against XLA's 19.7, and the 8B's tp 2 step 3.52 ms
    against 4.36 (docs/decisions.md)."""
    if (plan.in_out_weights or _rows(x) != 1 or (isinstance(w, QuantWeight) and w.block is not None)
            or not linear_kernel(plan, 1, w.shape, fused=True, dtype=_stored_dtype(w))):
        return linear(plan, x, w, out_dtype=jnp.float32)
    return _fused_linear(plan, x, w, kernel=True, out_dtype=jnp.float32)


def reduce_add(y, residual, bias=None):
    """residual + (sum over the devices of each one's partial y [+ bias]): a row-parallel
    projection's output (f32 partial sums, rounded once, after the sum, as tp 1 rounds its
    dot). Inside a per-shard layer only."""
    y = jax.lax.psum(y, TP_AXIS).astype(residual.dtype)
    return residual + (y if bias is None else y + bias)


def per_shard_layer(plan: KernelPlan, fn, weights: dict, splits: dict, x, meta, k_pages, v_pages, rope):
    """``fn(weights, x, meta, k_pages, v_pages, rope) -> (x, k_pages, v_pages)`` once per
    device under shard_map: each device gets its block of each weight (``splits[name]``:
    weight_partition) and of the cache's KV heads; x (the residual stream), the metadata
    and rope replicated. fn calls reduce_add where a partial sum needs the other devices'."""
    heads, rep = _KV_HEADS, P()
    wspecs = {k: _quant_partition(plan, splits.get(k), w) if isinstance(w, QuantWeight)
              else weight_partition(plan, splits.get(k), w.ndim) for k, w in weights.items()}
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=(wspecs, rep, rep, heads, heads, rep),
                         out_specs=(rep, heads, heads), check_vma=False)(weights, x, meta, k_pages, v_pages, rope)
