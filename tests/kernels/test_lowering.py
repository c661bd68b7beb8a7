"""Every Pallas kernel in kernels_pallas/ lowers, on this CPU machine, for the platform it
is dispatched to: the Triton-backend GPU kernels for "cuda" (Pallas -> Triton IR, carried
by a `__gpu$xla.gpu.triton` custom call), the Mosaic TPU kernels for "tpu" (a
`tpu_custom_call`), the latter for two chip descriptions (v5e, v6e).

Only the lowering runs (jax.jit(f).trace(*shapes).lower(lowering_platforms=...)): no PTX
or TPU compile, no execution: Mosaic's own passes (layouts, VMEM limits) run only when a
TPU compiles the custom call, so "lowers" is less than "compiles". Shapes are tiny, but for
the bf16 projections of 8B widths that take the tensor-core weight stream. Most
cases go through a kernel file's public entry for the platform (the one jspec/ops.py calls
for a GPU() or TPU() backend), so they also pin which kernels each entry reaches; every
case checks the exact list of custom calls (target and kernel name) in the lowered module. The chip
descriptions that let a CPU machine lower for GPU and TPU are the fixtures of
tests/kernels/conftest.py (gpu_target, tpu_chip).

Kernels (grep -n pallas_call kernels_pallas/*.py):
  paged_attention_gpu.py   main kernel + split-combine kernel       GPU
  paged_attention_tpu.py   paged attention                          TPU
  ragged_paged_attention_gpu.py  flat-token-batch attention         GPU
                           (+ paged_attention_gpu's split combine)
  ragged_paged_attention_tpu.py  flat-token-batch attention         TPU
  fused_linear.py          batch-1 projection (+ norm / SwiGLU)     GPU
  fused_linear_rows.py     2-16-row projection (+ norms, residual)  GPU
  fused_linear_split_k.py  one-row projection split over K (FP8)    GPU
  rope_kv_write.py         RoPE + paged KV write                    GPU
  qkv_rope_kv_write.py     RMSNorm + qkv + RoPE + KV write          GPU
  moe_experts.py           few-token MoE: gate_up + SwiGLU, down    GPU
  moe_experts_mxfp4.py     MXFP4 experts, dequantized in-kernel     GPU
  moe_router.py            MoE router: (norm, projection,) top-k    GPU
  rejection_blocks.py      stats + residual kernels: GPU ones (gpu_kernels),
                           TPU ones (tpu_kernels)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import paged_attention as pa
from kernels_pallas import ragged_paged_attention as rpa
from kernels_pallas.fused_linear import fused_linear
from kernels_pallas.fused_linear_rows import fused_linear_rows
from kernels_pallas.fused_linear_split_k import fused_linear_split_k
from kernels_pallas.moe_experts import moe_experts, moe_experts_gpu
from kernels_pallas.moe_experts_mxfp4 import moe_experts_mxfp4
from kernels_pallas.moe_router import norm_logits, router_top_k
from kernels_pallas.paged_attention_gpu import paged_attention_gpu
from kernels_pallas.paged_attention_tpu import paged_attention_tpu
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.rejection_sampling import gpu_kernels, rejection_sample, tpu_kernels
from kernels_pallas.rope_kv_write import rope_kv_write
from tests.helpers.lowering import MOSAIC, TRITON, custom_calls, lower

BF16, F32, I32, FP8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.float8_e4m3fn


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def assert_calls(text, expected):
    """expected: [(target, kernel-name regex)] in program order, nothing else."""
    calls = custom_calls(text)
    assert len(calls) == len(expected), f"custom calls {calls}, expected {expected}"
    for (target, name), (want_target, want_name) in zip(calls, expected):
        assert target == want_target, f"custom calls {calls}, expected {expected}"
        assert name is not None and re.fullmatch(want_name, name), f"custom calls {calls}, expected {expected}"


# ---- the cases -------------------------------------------------------------------------
# Each builder returns (fn, arg shapes, expected calls). fn closes over the static args.


def attention_shapes(dtype, *, B=2, Q=3, H=4, KVH=2, D=128, P=6, S=16, W=3, causal=True, cache=None):
    cache = cache or dtype  # the pages' dtype (FP8: an FP8 KV cache)
    shapes = [sds((B, Q, H, D), dtype), sds((P, S, KVH, D), cache), sds((P, S, KVH, D), cache),
              sds((B, W), I32), sds((B,), I32), sds((B, Q), I32)]
    if causal:
        shapes.append(sds((B,), jnp.bool_))
    return shapes


def attention_entry(platform, dtype, causal, cache=None):
    """The platform's public entry, kv splits at their default (1 for this short context)."""
    entry = pa.kernel_gpu if platform == "gpu" else pa.kernel_tpu

    def fn(*a):
        return entry(*a, sm_scale=0.125)
    name = r"paged_attention_gpu_r\d+_k\d+_s1" if platform == "gpu" else r"paged_attention_tpu_p\d+_r\d+"
    return fn, attention_shapes(dtype, causal=causal, cache=cache), [(TRITON if platform == "gpu" else MOSAIC, name)]


def attention_gpu_splits(dtype, split_combine):
    """kv splits > 1: the main kernel, then the combine kernel (or the jnp combine)."""
    def fn(*a):
        return paged_attention_gpu(*a, sm_scale=0.125, block_kv=16, kv_splits=2, split_combine=split_combine)
    calls = [(TRITON, r"paged_attention_gpu_r\d+_k16_s2")]
    if split_combine == "kernel":
        calls.append((TRITON, r"paged_attention_combine_s2"))
    return fn, attention_shapes(dtype, D=64, S=8, W=4), calls


def attention_gpu_sinks(dtype, kv_splits):
    """gpt-oss: sinks (in the model's dtype, as ops.attention passes them) and a sliding window
    (in the kernel with one split, in the combine kernel with two)."""
    def fn(*a):
        return paged_attention_gpu(*a[:-1], a[-1], sm_scale=0.125, block_kv=16, kv_splits=kv_splits, window=24)
    calls = [(TRITON, rf"paged_attention_gpu_r\d+_k16_s{kv_splits}_sinks_w24")]
    if kv_splits > 1:
        calls.append((TRITON, rf"paged_attention_combine_s{kv_splits}"))
    return fn, attention_shapes(dtype, D=64, S=8, W=4) + [sds((4,), dtype)], calls


def attention_tpu_blocks(dtype):
    """Several kv steps (pages_per_block < table width) and row blocks (Q * G > block_rows)."""
    def fn(*a):
        return paged_attention_tpu(*a, sm_scale=0.125, pages_per_block=2, block_rows=16)
    return fn, attention_shapes(dtype, Q=8, H=8, KVH=2, W=5), [(MOSAIC, r"paged_attention_tpu_p2_r16")]


def ragged_shapes(dtype, *, T=8, H=4, KVH=2, D=128, P=6, S=16, N=3, W=3, causal=True, cache=None):
    """q [T, H, D], k/v pages (in ``cache``, default q's dtype), cu_q_lens [N + 1], kv_lens [N],
    page_table [N, W], num_seqs [1][, causal [N]]."""
    cache = cache or dtype
    shapes = [sds((T, H, D), dtype), sds((P, S, KVH, D), cache), sds((P, S, KVH, D), cache), sds((N + 1,), I32),
              sds((N,), I32), sds((N, W), I32), sds((1,), I32)]
    if causal:
        shapes.append(sds((N,), jnp.bool_))
    return shapes


def ragged_entry(platform, dtype, causal, cache=None, **tuning):
    """The platform's public entry of the flat-batch attention; one kv split at this short context."""
    entry = rpa.kernel_gpu if platform == "gpu" else rpa.kernel_tpu

    def fn(*a):
        return entry(*a, sm_scale=0.125, **tuning)
    name = r"ragged_paged_attention_gpu_q\d+_k64_s1" if platform == "gpu" else r"ragged_paged_attention_tpu_q\d+_p\d+"
    if tuning:  # TPU: block_q tokens, block_kv // S pages per kv step
        name = rf"ragged_paged_attention_tpu_q{tuning['block_q']}_p{tuning['block_kv'] // 16}"
    return fn, ragged_shapes(dtype, causal=causal, cache=cache), [(TRITON if platform == "gpu" else MOSAIC, name)]


def ragged_gpu_splits(dtype):
    """kv splits > 1: the ragged kernel, then paged_attention_gpu's combine kernel."""
    def fn(*a):
        return ragged_paged_attention_gpu(*a, sm_scale=0.125, block_q=2, block_kv=16, kv_splits=2)
    calls = [(TRITON, r"ragged_paged_attention_gpu_q2_k16_s2"), (TRITON, r"paged_attention_combine_s2")]
    return fn, ragged_shapes(dtype, D=64, S=8, W=4), calls


# Weight shapes by stream: bf16 / f16 weights of 8B widths take the tensor-core stream; narrower
# ones, and f32, the elementwise one (kernels_pallas/tuning.py). Lowering costs the same at any size.
MMA_FK, NARROW_FK = (4096, 4096), (64, 128)
FP8_MMA_FK = (28672, 4096)  # gate_up's width: FP8 through float16 tensor-core dots (tuning.linear_fp8_mma)


def linear(prologue, dtype, *, residual=False, bias=False, handoff=False, narrow=False, fk=None, fp8=False):
    """fused_linear (the kernel) on one row: the kernel with its prologue, through the
    tensor-core stream for bf16 at 8B widths (else the elementwise one); fk: another [F, K]
    (gpt-oss's K = 2880: a masked last chunk); fp8: FP8 weights with their per-channel scale
    (the elementwise stream, at 8B widths unless narrow; the float16 tensor-core one at FP8_MMA_FK)."""
    mma = (dtype == BF16 and not narrow and fk is None and not fp8) or (fp8 and fk == FP8_MMA_FK)
    F, K = fk or (MMA_FK if (mma or fp8) and not narrow else NARROW_FK)
    k_in = 2 * K if prologue == "silu_mul" else K
    shapes = {"x": sds((1, 1, k_in), dtype), "w": sds((F, K), FP8 if fp8 else dtype)}
    if fp8:
        shapes["w_scale"] = sds((F,), F32)
    if prologue == "rmsnorm":
        shapes["norm_w"] = sds((K,), dtype)
    if bias:
        shapes["bias"] = sds((F,), dtype)
    if residual:
        shapes["residual"] = sds((1, 1, F), dtype)
    if handoff:  # the RMSNorm hand-over: o_proj writes h * w_next and sums of h^2 ...
        shapes["next_norm_w"] = sds((F,), dtype)
    names = list(shapes)

    def fn(*a):
        kw = dict(zip(names, a))
        return fused_linear(kw.pop("x"), kw.pop("w"), prologue=prologue, eps=1e-5, **kw)
    suffix = ("_fp8" if fp8 else "") + ("_norm_out" if handoff else "")
    return fn, list(shapes.values()), [(TRITON, rf"fused_linear_{prologue}_f\d+_d\d+{'_mma' if mma else ''}{suffix}")]


def linear_sumsq(dtype):
    """... and down_proj's kernel scales gate|up by 1 / rms from those sums (silu_mul + sumsq)."""
    F, K = MMA_FK

    def fn(x, w, sumsq, res):
        return fused_linear(x, w, prologue="silu_mul", sumsq=sumsq, residual=res)
    shapes = [sds((1, 1, 2 * K), dtype), sds((F, K), dtype), sds((1, 1, 3), F32), sds((1, 1, F), dtype)]
    return fn, shapes, [(TRITON, r"fused_linear_silu_mul_f\d+_d\d+_mma")]


def linear_split_k():
    """fused_linear_split_k (its public entry, the device's split) on the 8B's FP8 down_proj:
    SwiGLU on the handed-over norm, per-channel scale, residual."""
    F, K = 4096, 14336

    def fn(x, w, w_scale, sumsq, res):
        return fused_linear_split_k(x, w, prologue="silu_mul", sumsq=sumsq, residual=res, w_scale=w_scale)
    shapes = [sds((1, 1, 2 * K), BF16), sds((F, K), FP8), sds((F,), F32), sds((1, 1, 3), F32), sds((1, 1, F), BF16)]
    return fn, shapes, [(TRITON, "fused_linear_split_k_silu_mul_s4_f64_d256_mma_fp8")]


def linear_rows(R, *, norm_in=False, handoff=False, bias=False, fk=MMA_FK, fp8=False):
    """fused_linear_rows (the kernel) on R rows of bf16 at 8B widths (or ``fk``): [a
    handed-over input norm (sumsq),] [bias,] residual [, the next norm handed over]; fp8:
    FP8 weights with their per-channel scale."""
    F, K = fk
    shapes = {"x": sds((R, K), BF16), "w": sds((F, K), FP8 if fp8 else BF16), "residual": sds((R, F), BF16)}
    if fp8:
        shapes["w_scale"] = sds((F,), F32)
    if norm_in:
        shapes["sumsq"] = sds((R, 3), F32)
    if bias:
        shapes["bias"] = sds((F,), BF16)
    if handoff:
        shapes["next_norm_w"] = sds((F,), BF16)
    names = list(shapes)

    def fn(*a):
        kw = dict(zip(names, a))
        return fused_linear_rows(kw.pop("x"), kw.pop("w"), eps=1e-5, blocks=(32, 256, 4, 5) if fp8 else None, **kw)
    name = (rf"fused_linear_rows_r{R}_f\d+_d\d+{'_norm_in' if norm_in else ''}{'_norm_out' if handoff else ''}"
            rf"{'_fp8' if fp8 else ''}")
    return fn, list(shapes.values()), [(TRITON, name)]


def linear_rows_swiglu(R, fp8=False):
    """... gate_up + SwiGLU on a handed-over norm: [R, 2I] weight rows in, silu(g) * u out."""
    def fn(x, w, sumsq, *scale):
        return fused_linear_rows(x, w, sumsq=sumsq, eps=1e-5, swiglu=True, w_scale=scale[0] if scale else None,
                                 blocks=(64, 256, 4, 3) if fp8 else None)
    shapes = [sds((R, 4096), BF16), sds((28672, 4096), FP8 if fp8 else BF16), sds((R, 128), F32)]
    shapes += [sds((28672,), F32)] if fp8 else []
    return fn, shapes, [(TRITON, rf"fused_linear_rows_r{R}_f\d+_d\d+_swiglu_norm_in{'_fp8' if fp8 else ''}")]


def rope_write(dtype, qk_norm, H=4, cache=None):
    """H = 0: k and v only (DFlash's context K/V); cache: the pages' dtype (FP8)."""
    M, KVH, D, P, S = 2, 2, 64, 4, 8
    cache = cache or dtype

    def fn(qkv, cos, sin, slots, kp, vp, *norms):
        return rope_kv_write(qkv, cos, sin, slots, kp, vp, *norms, num_heads=H)
    shapes = [sds((M, (H + 2 * KVH) * D), dtype), sds((M, D // 2), F32), sds((M, D // 2), F32), sds((M,), I32),
              sds((P, S, KVH, D), cache), sds((P, S, KVH, D), cache)]
    if qk_norm:
        shapes += [sds((D,), dtype), sds((D,), dtype)]
    return fn, shapes, [(TRITON, r"rope_kv_write" if H else r"rope_kv_write_kv_only")]


def qkv_rope_write(dtype, bias, gpt_oss=False, fp8=False, cache=None):
    H, KVH, D, K, P, S = (32, 8, 128, 4096, 4, 8) if dtype == BF16 else (4, 2, 64, 128, 4, 8)
    if gpt_oss:  # K = 2880 = 5 x 512 + a masked 320, the elementwise stream
        H, KVH, D, K = 64, 8, 64, 2880
    F = (H + 2 * KVH) * D

    def fn(x, w, norm_w, cos, sin, slots, kp, vp, *extra):
        b, scale = (extra[0] if bias else None), (extra[-1] if fp8 else None)
        return qkv_rope_kv_write(x, w, norm_w, b, cos, sin, slots, kp, vp, num_heads=H, eps=1e-5, w_scale=scale)
    shapes = [sds((1, K), dtype), sds((F, K), FP8 if fp8 else dtype), sds((K,), dtype), sds((1, D // 2), F32),
              sds((1, D // 2), F32), sds((1,), I32), sds((P, S, KVH, D), cache or dtype),
              sds((P, S, KVH, D), cache or dtype)]
    if bias:
        shapes.append(sds((F,), dtype))
    if fp8:
        shapes.append(sds((F,), F32))
    mma = "_mma" if dtype == BF16 and not gpt_oss and not fp8 else ""  # bf16 weights of 8B widths: the tensor-core form
    return fn, shapes, [(TRITON, rf"qkv_rope_kv_write_p\d+_d\d+{mma}{'_fp8' if fp8 else ''}")]


def moe(dtype, mma=False):
    """moe_experts: the gate_up kernel, then the down kernel; their default tiles
    (the elementwise stream: experts are narrow), or tensor-core tiles given (mma)."""
    N, K, E, I, H = 2, 2, 4, 32, 64

    def fn(x, experts, w_gate_up, w_down):
        if mma:
            return moe_experts_gpu(x, experts, w_gate_up, w_down, top_k=K, blocks=((16, 32, 4, 3, True),) * 2)
        return moe_experts(x, experts, w_gate_up, w_down, top_k=K)
    shapes = [sds((N, H), dtype), sds((N * K,), I32), sds((E, 2 * I, H), dtype), sds((E, H, I), dtype)]
    suffix = "_mma" if mma else ""
    return fn, shapes, [(TRITON, rf"moe_gate_up_f\d+_d\d+{suffix}"), (TRITON, rf"moe_down_f\d+_d\d+{suffix}")]


def moe_mxfp4(dtype, N=1, summed=False):
    """moe_experts_mxfp4: the packed gate_up kernel (biases, clamped SwiGLU), then the packed
    down kernel; gpt-oss's H = 2880 (90 blocks of 32: a masked last step). N = 2 (8 pairs):
    the tensor-core path (its PTX decode included). summed: with the pairs' weights and the
    residual, down's programs a token's, summing its pairs (ops.moe's batch-1 decode), on
    the CUDA-core stream at any pair count."""
    K, E, I, H = 4, 4, 64, 2880

    def fn(x, experts, gub, gus, db, ds, bgu, bd, *combine):
        weights, residual = combine or (None, None)
        return moe_experts_mxfp4(x, experts, gub, gus, db, ds, top_k=K, b_gate_up=bgu, b_down=bd, limit=7.0,
                                 weights=weights, residual=residual)
    U8 = jnp.uint8
    shapes = [sds((N, H), dtype), sds((N * K,), I32), sds((E, 2 * I, H // 32, 16), U8), sds((E, 2 * I, H // 32), U8),
              sds((E, H, I // 32, 16), U8), sds((E, H, I // 32), U8), sds((E, 2 * I), dtype), sds((E, H), dtype)]
    if summed:
        shapes += [sds((N, K), dtype), sds((N, H), dtype)]
    suffix = "_mma" if N * K >= 8 and not summed else ""
    down = "down_sum" if summed else "down"
    return fn, shapes, [(TRITON, rf"moe_mxfp4_gate_up_f\d+_g\d+{suffix}"), (TRITON, rf"moe_mxfp4_{down}_f\d+_g\d+{suffix}")]


def moe_router(E, top_k):
    """router_top_k: softmax and top-k in one kernel (E not a power of two: padded)."""
    def fn(logits):
        return router_top_k(logits, top_k=top_k, norm=True)
    return fn, [sds((3, E), F32)], [(TRITON, rf"moe_router_top{top_k}")]


def moe_norm_logits(E, H, bias):
    """norm_logits: the norm and the router's projection in one kernel (gpt-oss's H = 2880:
    padded to 4096, masked; E = 60: a partial last block of experts where a program holds 2)."""
    def fn(x, w, norm_w, *b):
        return norm_logits(x, w, norm_w=norm_w, eps=1e-5, bias=b[0] if b else None)
    shapes = [sds((2, H), BF16), sds((E, H), BF16), sds((H,), BF16)] + ([sds((E,), BF16)] if bias else [])
    return fn, shapes, [(TRITON, "moe_router_logits")]


def rejection(platform, *, V, draft_probs, dtype=F32, bpp=1):
    """rejection_sample(kernels=gpu_kernels() | tpu_kernels()): the stats kernel, plus the
    residual kernel when draft probabilities are given."""
    B, K = 2, 3
    kernels = gpu_kernels(blocks_per_program=bpp) if platform == "gpu" else tpu_kernels()

    def fn(logits, drafts, nd, temp, top_k, top_p, seeds, pos, *q):
        return rejection_sample(logits, drafts, nd, q[0] if q else None, temp, top_k, top_p, seeds, pos,
                                kernels=kernels, filtering="on")
    shapes = [sds((B, K + 1, V), dtype), sds((B, K), I32), sds((B,), I32), sds((B,), F32), sds((B,), I32),
              sds((B,), F32), sds((B,), I32), sds((B,), I32)]
    if draft_probs:
        shapes.append(sds((B, K, V), F32))
    target = TRITON if platform == "gpu" else MOSAIC
    calls = [(target, f"rejection_stats_{platform}")]
    if draft_probs:
        calls.append((target, f"rejection_resid_{platform}"))
    return fn, shapes, calls


def ragged_gpu_sinks(dtype):
    """gpt-oss: sinks and a sliding window, kv splits > 1 (the sinks in the combine kernel)."""
    def fn(*a):
        return ragged_paged_attention_gpu(*a[:-1], a[-1], sm_scale=0.125, block_q=2, block_kv=16, kv_splits=2,
                                          window=24)
    calls = [(TRITON, r"ragged_paged_attention_gpu_q2_k16_s2_sinks_w24"), (TRITON, r"paged_attention_combine_s2")]
    return fn, ragged_shapes(dtype, D=64, S=8, W=4) + [sds((4,), dtype)], calls


GPU_CASES = {
    "paged_attention-bf16": lambda: attention_entry("gpu", BF16, causal=False),
    "paged_attention-f32-causal": lambda: attention_entry("gpu", F32, causal=True),
    "paged_attention-splits-combine_kernel": lambda: attention_gpu_splits(BF16, "kernel"),
    "paged_attention-splits-combine_jnp": lambda: attention_gpu_splits(F32, "jnp"),
    "paged_attention-sinks-window-bf16": lambda: attention_gpu_sinks(BF16, 1),
    "paged_attention-sinks-window-splits-f32": lambda: attention_gpu_sinks(F32, 2),
    "paged_attention-sinks-window-splits-bf16": lambda: attention_gpu_sinks(BF16, 2),
    "ragged_paged_attention-bf16": lambda: ragged_entry("gpu", BF16, causal=True),
    "ragged_paged_attention-f32-all_causal": lambda: ragged_entry("gpu", F32, causal=False),
    "ragged_paged_attention-splits-combine": lambda: ragged_gpu_splits(BF16),
    "ragged_paged_attention-sinks-window-splits": lambda: ragged_gpu_sinks(F32),
    "ragged_paged_attention-sinks-window-splits-bf16": lambda: ragged_gpu_sinks(BF16),
    "fused_linear-rmsnorm-bf16": lambda: linear("rmsnorm", BF16, bias=True),
    "fused_linear-rmsnorm-f32": lambda: linear("rmsnorm", F32),
    "fused_linear-rmsnorm-narrow-bf16": lambda: linear("rmsnorm", BF16, narrow=True),
    "fused_linear-none-residual-handoff-bf16": lambda: linear("none", BF16, residual=True, handoff=True),
    "fused_linear-silu_mul-residual-f32": lambda: linear("silu_mul", F32, residual=True),
    "fused_linear-silu_mul-sumsq-bf16": lambda: linear_sumsq(BF16),
    "fused_linear-rmsnorm-K2880-bf16": lambda: linear("rmsnorm", BF16, fk=(2880, 2880)),
    "fused_linear_rows-8-K2880": lambda: linear_rows(8, fk=(2880, 2880)),
    "qkv_rope_kv_write-K2880-bf16": lambda: qkv_rope_write(BF16, bias=True, gpt_oss=True),
    "fused_linear_rows-16-norm_in-bias": lambda: linear_rows(16, norm_in=True, bias=True),
    "fused_linear_rows-4-handoff": lambda: linear_rows(4, handoff=True),
    "fused_linear_rows-3-norm_in-handoff": lambda: linear_rows(3, norm_in=True, handoff=True),
    "fused_linear_rows-8-swiglu": lambda: linear_rows_swiglu(8),
    # FP8 weights (per-channel scale): the one-row kernels' elementwise stream (their default) at
    # 8B widths; fused_linear_rows' tensor-core stream (tiles given: XLA's dots by default)
    "fused_linear-rmsnorm-fp8": lambda: linear("rmsnorm", BF16, fp8=True),
    "fused_linear-none-fp8-mma": lambda: linear("none", BF16, fp8=True, fk=FP8_MMA_FK),
    "fused_linear-silu_mul-residual-handoff-fp8": lambda: linear("silu_mul", BF16, residual=True, handoff=True,
                                                                 fp8=True),
    "fused_linear-none-narrow-fp8": lambda: linear("none", BF16, narrow=True, residual=True, fp8=True),
    "fused_linear_split_k-silu_mul-sumsq-fp8": linear_split_k,
    "fused_linear_rows-16-norm_in-fp8": lambda: linear_rows(16, norm_in=True, fp8=True),
    "fused_linear_rows-8-swiglu-fp8": lambda: linear_rows_swiglu(8, fp8=True),
    "qkv_rope_kv_write-fp8": lambda: qkv_rope_write(BF16, bias=False, fp8=True),
    # an FP8 KV cache: read by the attention kernels, written by the RoPE + KV-write kernels
    "paged_attention-fp8_cache": lambda: attention_entry("gpu", BF16, causal=True, cache=FP8),
    "ragged_paged_attention-fp8_cache": lambda: ragged_entry("gpu", BF16, causal=True, cache=FP8),
    "rope_kv_write-fp8_cache": lambda: rope_write(BF16, qk_norm=True, cache=FP8),
    "qkv_rope_kv_write-fp8_cache": lambda: qkv_rope_write(BF16, bias=False, cache=FP8),
    "rope_kv_write-bf16": lambda: rope_write(BF16, qk_norm=False),
    "rope_kv_write-qk_norm-f32": lambda: rope_write(F32, qk_norm=True),
    "rope_kv_write-kv_only-qk_norm-bf16": lambda: rope_write(BF16, qk_norm=True, H=0),
    "qkv_rope_kv_write-bf16": lambda: qkv_rope_write(BF16, bias=False),
    "qkv_rope_kv_write-bias-f32": lambda: qkv_rope_write(F32, bias=True),
    "moe_experts-bf16": lambda: moe(BF16),
    "moe_experts-f32": lambda: moe(F32),
    "moe_experts-mma-bf16": lambda: moe(BF16, mma=True),
    "moe_experts_mxfp4-bf16": lambda: moe_mxfp4(BF16),
    "moe_experts_mxfp4-mma-bf16": lambda: moe_mxfp4(BF16, N=2),
    "moe_experts_mxfp4-summed-bf16": lambda: moe_mxfp4(BF16, summed=True),
    "moe_experts_mxfp4-summed-n2-bf16": lambda: moe_mxfp4(BF16, N=2, summed=True),
    "moe_router_logits-32x2880-bias": lambda: moe_norm_logits(32, 2880, True),
    "moe_router_logits-60x1024": lambda: moe_norm_logits(60, 1024, False),
    "moe_router-128x8": lambda: moe_router(128, 8),
    "moe_router-60x4": lambda: moe_router(60, 4),
    "rejection-stats": lambda: rejection("gpu", V=300, draft_probs=False),
    "rejection-stats-resid-bf16": lambda: rejection("gpu", V=300, draft_probs=True, dtype=BF16),
    "rejection-stats-resid-bpp2": lambda: rejection("gpu", V=4100, draft_probs=True, bpp=2),
}

TPU_CASES = {
    "paged_attention-bf16": lambda: attention_entry("tpu", BF16, causal=False),
    "paged_attention-f32-causal": lambda: attention_entry("tpu", F32, causal=True),
    "paged_attention-kv_steps-row_blocks-bf16": lambda: attention_tpu_blocks(BF16),
    "ragged_paged_attention-bf16": lambda: ragged_entry("tpu", BF16, causal=True),
    "ragged_paged_attention-f32-all_causal": lambda: ragged_entry("tpu", F32, causal=False),
    "ragged_paged_attention-blocks-bf16": lambda: ragged_entry("tpu", BF16, causal=True, block_q=8, block_kv=32),
    "rejection-stats": lambda: rejection("tpu", V=300, draft_probs=False),
    "rejection-stats-resid": lambda: rejection("tpu", V=300, draft_probs=True),
    "rejection-stats-resid-narrow_vocab-bf16": lambda: rejection("tpu", V=100, draft_probs=True, dtype=BF16),
}

# Kernels that do not lower for their platform: case name -> the exact error (strict xfail).
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _params(cases, platform):
    out = []
    for name in cases:
        reason = KNOWN_FAILURES.get((platform, name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params(GPU_CASES, "cuda"))
def test_gpu_kernel_lowers_for_cuda(case, gpu_target):
    fn, shapes, expected = GPU_CASES[case]()
    assert_calls(lower(fn, shapes, "cuda"), expected)


@pytest.mark.parametrize("case", _params(TPU_CASES, "tpu"))
def test_tpu_kernel_lowers_for_tpu(case, tpu_chip):
    fn, shapes, expected = TPU_CASES[case]()
    assert_calls(lower(fn, shapes, "tpu"), expected)


def test_every_pallas_call_is_covered():
    """A new pallas_call in kernels_pallas/ must get a lowering case here: this counts the
    pallas_call sites per file, which the cases above were written against."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "kernels_pallas"
    sites = {}
    for path in sorted(root.glob("*.py")):
        src = path.read_text()
        n_calls = len(re.findall(r"\bpl\.pallas_call\(", src))
        if n_calls:
            sites[path.name] = n_calls
    assert sites == {
        "fused_linear.py": 1,
        "fused_linear_rows.py": 1,
        "fused_linear_split_k.py": 1,
        "moe_experts.py": 2,
        "moe_experts_mxfp4.py": 1,  # gate_up's and down's kernels through one call site
        "moe_router.py": 2,  # router_top_k's and norm_logits' kernels
        "paged_attention_gpu.py": 2,
        "paged_attention_tpu.py": 1,
        "qkv_rope_kv_write.py": 1,
        "ragged_paged_attention_gpu.py": 1,  # + paged_attention_gpu.py's combine kernel
        "ragged_paged_attention_tpu.py": 1,
        "rejection_blocks.py": 2,  # _gpu_call (stats, resid kernels) and _tpu_call (stats, resid)
        "rope_kv_write.py": 1,
    }, "pallas_call sites changed: add lowering cases for the new kernels and update this list"


def test_reference_lowers_without_kernels(gpu_target):
    """The reference lowers to plain XLA for either platform (no custom call)."""
    fn = lambda *a: pa.ref_paged_attention(*a, sm_scale=0.125)  # noqa: E731
    shapes = attention_shapes(BF16)
    assert custom_calls(lower(fn, shapes, "cuda")) == []
    assert custom_calls(lower(fn, shapes, "tpu")) == []


def test_device_tuning_table():
    """Kernel grids read the chip's SM count from kernels_pallas/tuning.py: listed devices
    by kind, an unlisted GPU by the count jax reports, anything else the H200's (the
    device the rules were tuned on; CPU interpret runs see exactly the H200's choices)."""
    from types import SimpleNamespace as NS

    from kernels_pallas.paged_attention_gpu import default_kv_splits
    from kernels_pallas.tuning import DEFAULT, device_tuning

    assert device_tuning(NS(device_kind="NVIDIA H200", platform="gpu")).num_sms == 132
    assert device_tuning(NS(device_kind="NVIDIA H100 PCIe", platform="gpu")).num_sms == 114
    assert device_tuning(NS(device_kind="Some Future GPU", platform="gpu", core_count=96)).num_sms == 96
    assert device_tuning(NS(device_kind="Some Future GPU", platform="gpu")) == DEFAULT
    assert device_tuning(NS(device_kind="cpu", platform="cpu", core_count=2)) == DEFAULT
    assert device_tuning() == DEFAULT  # this machine's CPU
    # The H200's choices, pinned: batch 1 and 32 decode at context 512 / 4096 (64-key blocks).
    assert [default_kv_splits(b, 8, 1, n, 132) for b, n in ((1, 8), (1, 64), (32, 64))] == [8, 64, 2]
    assert default_kv_splits(1, 8, 1, 64, 114) == 57


def test_tile_tables():
    """Projection tiles come from the device's table rows (first match by weight shape),
    shrunk to divisors of the shape; the H200's rows, pinned on the 8B layer shapes and on
    narrower ones (Qwen3-30B-A3B's attention, Llama-3.2-1B), which take the elementwise
    stream in bf16 too. The elementwise table ends with a row that takes any shape."""
    from kernels_pallas.fused_linear import default_blocks, default_mma_blocks, one_row_blocks
    from kernels_pallas.qkv_rope_kv_write import kernel_blocks
    from kernels_pallas.tuning import DEVICES

    assert default_blocks(6144, 4096) == (8, 512, 4, 4)
    assert default_blocks(4096, 14336) == (16, 1024, 8, 2)
    assert default_blocks(4096, 14338) is None  # no K chunk of >= 32 divides it
    assert default_mma_blocks(6144, 4096, BF16) == (64, 256, 4, 4, True)
    assert default_mma_blocks(4096, 4096, BF16) == (32, 256, 4, 6, True)
    assert default_mma_blocks(4096, 14336, BF16) == (32, 512, 4, 6, True)
    assert default_mma_blocks(6144, 8192, BF16) == (32, 512, 4, 6, True)  # EAGLE3's qkv over [embeds | hidden]
    assert default_mma_blocks(8192, 14336, BF16) == (32, 256, 4, 4, True)  # 70B's down at tp 2
    assert default_mma_blocks(4096, 4096, jnp.float32) is None
    # Narrower weights: no tensor-core row takes them.
    assert default_mma_blocks(5120, 2048, BF16) is None and default_mma_blocks(2048, 4096, BF16) is None
    assert one_row_blocks(5120, 2048, BF16) == (8, 512, 4, 4, False)
    assert one_row_blocks(2048, 4096, BF16) == (8, 2048, 8, 4, False)
    assert one_row_blocks(2048, 8192, BF16) == (8, 2048, 8, 4, False)
    assert one_row_blocks(6144, 4096, BF16) == (64, 256, 4, 4, True)
    # qkv + RoPE + KV write: pairs from the projection's row (8B: tensor-core, 1B: elementwise).
    assert kernel_blocks(6144, 4096, 128, BF16) == (32, 256, 4, 4, True)
    assert kernel_blocks(3072, 2048, 64, BF16) == (4, 2048, 8, 4, False)
    # ... unless the qkv table takes it first (70B's qkv at tp 2: 2 x 32 rows, not the projection's 2 x 16).
    assert kernel_blocks(5120, 8192, 128, BF16) == (32, 512, 4, 4, True)
    assert kernel_blocks(5120, 8192, 128, jnp.float8_e4m3fn)[4] is False  # FP8: the elementwise stream
    for t in DEVICES.values():
        assert (t.linear[-1].min_k, t.linear[-1].min_f) == (0, 0)
        assert t.linear_tile(1, 1, False) == t.linear[-1]
        assert t.linear_tile(1, 1, True) is None
