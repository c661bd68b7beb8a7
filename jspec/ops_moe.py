"""Mixture-of-experts layers: which way and which kernels serve the experts (the MoE half of
the ops facade, jspec/ops.py, which re-exports ``moe``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jspec.kernel_backend import GPU
from jspec.kernel_plan import KernelPlan
from jspec.mxfp4 import Mxfp4Weight
from jspec.quantization import QuantWeight
from kernels_pallas import moe_experts as _moe
from kernels_pallas import moe_experts_mxfp4 as _mxfp4
from kernels_pallas import moe_router as _router

# Tokens per dense pass of ``moe`` when the pairs outnumber the experts: bounds its [C, E, 2I]
# intermediate (C * E * 2I elements: 200 MB of bf16 for Qwen3-30B-A3B's 128 x 1536 at 512). One
# such layer on an H100 at 1024 tokens: 2.72 ms in passes of 256, 2.41 of 512, 2.16 of 1024.
MOE_DENSE_CHUNK = 512
# moe's few-pair way (at most E pairs) takes kernels_pallas/moe_experts.py's kernels, with the
# plan's GPU kernels, from this fraction of E pairs up. Decode of the Qwen3-30B-A3B shape on an
# H100 (scripts/bench_moe_kernel_ab.py, docs/bench/2026-11-27_moe_kernel_ab_h100.log), XLA's
# gather against the kernels: batch 1 (8 pairs) 3.76 vs 4.08 ms a step, batch 4 (32) 7.10-7.19
# vs 7.14-7.26, batch 16 (128) 21.4 vs 16.7.
MOE_KERNEL_MIN_FRACTION = 0.5
# MXFP4 experts take kernels_pallas/moe_experts_mxfp4.py (with the plan's GPU kernels) up to
# this many pairs per expert: the dense way dequantizes every expert once, the kernels stream
# each pair's expert packed. H200, gpt-oss-20b's layer (scripts/bench_moe_mxfp4.py, raw
# docs/bench/2026-12-01_moe_mxfp4_fraction_h200.log): the kernels 625 / 1,218 / 2,379 us at
# 4 / 8 / 16 E pairs (32 / 64 / 128 tokens), XLA's dense way 3,244 / 3,262 / 3,300: ~4.7 us a
# pair against a flat ~3.3 ms, equal near 22 E. Both scale with the expert's bytes, so the
# fraction holds for gpt-oss-120b's 128 experts.
MXFP4_KERNEL_MAX_FRACTION = 16


def moe(plan: KernelPlan, x, w_router, w_gate_up, w_down, *, top_k: int, norm_topk_prob: bool, residual=None,
        chunk: int = MOE_DENSE_CHUNK, b_router=None, b_gate_up=None, b_down=None, swiglu_limit: float = 0.0,
        swiglu_alpha: float = 1.702):
    """Qwen3-MoE's sparse MLP: [residual +] sum over the top_k experts e of the softmax router
    (f32; renormalised over the chosen when norm_topk_prob, then cast to x's dtype) of
    w_e * down_e(silu(g_e) * u_e). x: f[..., H] or Normed; w_router: [E, H] (a Linear's
    layout); w_gate_up: [E, 2I, H]; w_down: [E, H, I] (HF [out, in] per expert). The
    router's softmax and top-k: one kernel with the plan's GPU kernels
    (kernels_pallas/moe_router.py), else XLA's softmax and lax.top_k.

    Two ways, by the static number of (token, expert) pairs:
      - at most E pairs (decode, a verification block at small batch): each pair's expert
        MLP alone: XLA's gather, which XLA fuses into the dots' reductions (no copy of the
        experts: one Qwen3-30B-A3B layer's expert projections at 1 token in 25.5 us of GPU
        time on an H100, 2.96 TB/s; docs/bench/2026-11-27_moe_layer_gpu_time_h100.log), or
        from MOE_KERNEL_MIN_FRACTION * E pairs up, with the plan's GPU kernels,
        kernels_pallas/moe_experts.py, one weight stream per pair (faster there);
      - more: every expert for every token, weights zero off the chosen (two batched GEMMs
        over the stacked weights, ``chunk`` tokens a pass). Each expert streams once, at
        E / top_k times the needed FLOPs, which the GPU has to spare up to a few hundred
        tokens: one such layer on an H100 in 0.51 ms at 64 tokens, 0.70 at 256 and 2.4 at
        1024 (compute-bound there), where the gather re-reads an expert per pair (1.6 ms at
        64) and XLA's grouped GEMM (lax.ragged_dot) took 1.8, 4.3 and 14.6 ms
        (docs/bench/2026-11-27_moe_layer_dense_h100.log).
    Each token sums its top_k rows (zeros elsewhere add nothing on the dense way).
    gpt-oss: the router's bias b_router [E], the experts' b_gate_up [E, 2I] and b_down [E, H],
    the clamped SwiGLU (swiglu_limit > 0: kernels_pallas/moe_experts.swiglu); the expert
    kernels take none of them, so those layers run the XLA ways.
    FP8 and MXFP4 experts (QuantWeight, jspec/quantization.py; Mxfp4Weight, jspec/mxfp4.py)
    run the XLA ways: at most E pairs each pair's expert gathered still quantized, then
    dequantized; more, every expert dequantized. With the plan's GPU kernels, MXFP4 experts
    at most MXFP4_KERNEL_MAX_FRACTION * E pairs stream packed through
    kernels_pallas/moe_experts_mxfp4.py (biases and the clamped SwiGLU in the kernel); at the
    pair counts of its CUDA-core stream (below use_mma's) with a Normed x (the decoder layer's)
    the norm and the router's projection run as one kernel (moe_router.norm_logits) and down's
    kernel sums each token's pairs and adds the residual: on gpt-oss-20b at one token (H200, 2026-12-01,
    scripts/step_profile.py; raw docs/bench/2026-12-01_gpt_oss_step_kernels_h200.log) 8
    kernels a layer where 13 ran (339 -> 219 a step: each a CUDA graph node the host launches),
    GPU time 2.04 -> 1.94 ms a step, the jitted step back to back 2.49 -> 2.17 ms.
    Each token's weighted sum: moe_experts.combine_pairs (f32 over its pairs) on every way."""
    from jspec.ops import Normed, linear  # the facade's (it imports this module)

    shape, H = x.shape, x.shape[-1]
    N, E = math.prod(shape[:-1]), w_gate_up.shape[0]
    oss = dict(b_gate_up=b_gate_up, b_down=b_down, limit=swiglu_limit, alpha=swiglu_alpha)
    gpu = isinstance(plan.linear, GPU)
    mxfp4_kernel = (isinstance(w_gate_up, Mxfp4Weight) and gpu and N * top_k <= MXFP4_KERNEL_MAX_FRACTION * E
                    and _mxfp4.supports((N, H), w_gate_up.blocks.shape))
    if mxfp4_kernel and isinstance(x, Normed) and _router.norm_logits_supports(N, H) and \
            _router.supports(E, top_k) and w_router.shape == (E, H) and not isinstance(w_router, QuantWeight) \
            and not _mxfp4.use_mma(N * top_k, w_gate_up.shape[1] // 2, H, x.x.dtype):
        # the CUDA-core stream's pair counts (batch-1 decode): the norm and the router's
        # projection in one kernel, each token's weighted sum and the residual in down's: 5
        # kernels a layer fewer. (Taken on the tensor-core stream too, EAGLE3 K=3 on 20b read
        # 1.70 ms a token, 78% of its ideal, against 1.55 before on other hosts: not kept there.)
        interpret = plan.linear.interpret
        xn, logits = _router.norm_logits(x.x.reshape(N, H), w_router, norm_w=x.weight, eps=x.eps, bias=b_router,
                                         interpret=interpret)
        weights, experts = _router.router_top_k(logits, top_k=top_k, norm=norm_topk_prob, interpret=interpret)
        out = _mxfp4.moe_experts_mxfp4(
            xn.astype(w_gate_up.dtype), experts.reshape(-1), w_gate_up.blocks, w_gate_up.scales, w_down.blocks,
            w_down.scales, top_k=top_k, weights=weights, interpret=interpret,
            residual=None if residual is None else residual.reshape(N, H), **oss)
        return out.reshape(shape)
    x = x.value() if isinstance(x, Normed) else x
    xf = x.reshape(-1, H)  # [N, H]
    logits = linear(plan, xf, w_router, b_router).astype(jnp.float32)  # [N, E]
    plain_experts = b_gate_up is None and b_down is None and not swiglu_limit
    if gpu and _router.supports(E, top_k):
        weights, experts = _router.router_top_k(logits, top_k=top_k, norm=norm_topk_prob,
                                                interpret=plan.linear.interpret)  # [N, k]
    else:
        weights, experts = _router.ref_router_top_k(logits, top_k=top_k, norm=norm_topk_prob)
    weights = weights.astype(x.dtype)
    quant = isinstance(w_gate_up, (QuantWeight, Mxfp4Weight))
    if N * top_k <= E or mxfp4_kernel:  # y [N k, H]: pair j is token j // k
        if mxfp4_kernel:
            y = _mxfp4.moe_experts_mxfp4(xf.astype(w_gate_up.dtype), experts.reshape(-1), w_gate_up.blocks,
                                         w_gate_up.scales, w_down.blocks, w_down.scales, top_k=top_k,
                                         interpret=plan.linear.interpret, **oss)
        elif quant:
            pairs = experts.reshape(-1)  # each pair's expert gathered: pair p is row p of each
            take = lambda b: None if b is None else b[pairs]  # noqa: E731
            y = _moe.ref_moe_experts(xf, jnp.arange(pairs.shape[0]), w_gate_up.take(pairs).dequantize(),
                                     w_down.take(pairs).dequantize(), top_k=top_k, b_gate_up=take(b_gate_up),
                                     b_down=take(b_down), limit=swiglu_limit, alpha=swiglu_alpha)
        elif (gpu and plain_experts and N * top_k >= MOE_KERNEL_MIN_FRACTION * E
                and _moe.supports(w_gate_up.shape, w_down.shape, w_gate_up.dtype)):
            y = _moe.moe_experts(xf, experts.reshape(-1), w_gate_up, w_down, top_k=top_k,
                                 interpret=plan.linear.interpret)
        else:
            y = _moe.ref_moe_experts(xf, experts.reshape(-1), w_gate_up, w_down, top_k=top_k, **oss)
        out = _moe.combine_pairs(y, weights)
    else:
        if quant:
            w_gate_up, w_down = w_gate_up.dequantize(), w_down.dequantize()
        rows = jnp.arange(N)[:, None]
        dense_w = jnp.zeros((N, E), x.dtype).at[rows, experts].set(weights)  # [N, E]

        def dense(xc, wc):  # [C, H], [C, E] -> [C, H]
            gu = jnp.einsum("nh,eih->nei", xc, w_gate_up)
            if b_gate_up is not None:
                gu = gu + b_gate_up
            g, u = jnp.split(gu, 2, axis=-1)
            y = jnp.einsum("nei,ehi->neh", _moe.swiglu(g, u, swiglu_limit, swiglu_alpha), w_down)  # [C, E, H]
            if b_down is not None:
                y = y + b_down
            return (y * wc[..., None]).sum(1)

        if N <= chunk:
            out = dense(xf, dense_w)
        else:  # whole chunks (the last padded with zero rows), one pass each
            n = -(-N // chunk)
            pad = lambda a: jnp.pad(a, ((0, n * chunk - N), (0, 0))).reshape(n, chunk, -1)  # noqa: E731
            out = jax.lax.map(lambda c: dense(*c), (pad(xf), pad(dense_w))).reshape(n * chunk, H)[:N]
    out = out.reshape(shape)
    return out if residual is None else residual + out
