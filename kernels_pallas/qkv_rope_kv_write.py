"""Batch-1 attention input in one kernel: RMSNorm -> qkv projection -> RoPE -> paged KV
write. The composition of kernels_pallas/fused_linear.py (prologue "rmsnorm") and
kernels_pallas/rope_kv_write.py, for models without per-head q/k norms (Llama).

Why: after those two kernels a batch-1 Llama-3.1-8B decode layer still launched the RoPE +
KV-write kernel on its own: 3.1 us per layer, ~0.1 ms of a 4.3 ms step on the H200 (jax
0.11.2, 2026-11-21, scripts/bench.py --section diag), for 12 KB of data the projection
already holds in registers.

How: rotate-half RoPE pairs feature j of a head with feature j + D/2. Each program streams
two blocks of ``pairs`` weight rows, [j0, j0 + pairs) and [j0 + D/2, j0 + D/2 + pairs) of
one head, so both halves of its rotations end in the same program; it rounds them as the
projection's output is rounded, rotates them (q and k heads) like rope_kv_write, and
stores q to the output and k / v to their cache slot (in place, aliased; slot P * S, a
padding token, writes nothing). As many rows per program as the projection kernel's tile
(kernel_blocks): for bf16 2 x 32 rows x 256 through the tensor-core dot (fused_linear's
MMA form), else 2 x 4 rows x 512 elementwise; at K >= 8192 the device's own row (70B's
[5120, 8192] at tp 2: 2 x 32 rows x 512, 26.3 us against 49.1 at the projection's 2 x 16).
On the H200 (jax 0.11.2, 2026-11-21, profiler GPU time): 16.1 us per layer in the decode step with the MMA tiles against 17.7 elementwise
(scripts/bench.py --section diag); alone 18.7 against 22.1 us, and 2 x 16-row tiles 27.7-32.3
(scripts/bench_linear.py --qkv-rope-only --sweep). Qwen3's q / k norms need a whole head
per program first: that model keeps the two kernels (jspec.ops.qkv_rope_write).
An FP8 weight comes with its per-channel ``w_scale`` (fused_linear's FP8 form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import (
    _pow2_divisor,
    default_blocks,
    default_mma_blocks,
    dot_dtype,
    is_fp8,
    k_block,
    ref_fused_linear,
    stream_rows,
)
from kernels_pallas.paged_attention import kv_store
from kernels_pallas.rope_kv_write import ref_rope_kv_write
from kernels_pallas.tuning import device_tuning


def ref_qkv_rope_kv_write(x, w, norm_w, bias, cos, sin, slot_mapping, k_pages, v_pages, *, num_heads, eps,
                          w_scale=None):
    """jnp reference: the two references composed. x [M, K]; w [(H + 2 KVH) D, K]; norm_w [K];
    bias [(H + 2 KVH) D] | None; cos, sin f32[M, D/2]; slot_mapping i32[M]; caches
    [P, S, KVH, D]; w_scale f32[(H + 2 KVH) D]: an FP8 w's per-channel scale.
    -> (q [M, H, D], k_pages, v_pages)."""
    validate(x, w, norm_w, bias, cos, slot_mapping, k_pages, v_pages, num_heads)
    qkv = ref_fused_linear(x, w, prologue="rmsnorm", norm_w=norm_w, eps=eps, bias=bias, w_scale=w_scale)
    return ref_rope_kv_write(qkv, cos, sin, slot_mapping, k_pages, v_pages, num_heads=num_heads, eps=eps)


def _kernel(slot_ref, cos_ref, sin_ref, x_ref, w_lo, w_hi, norm_ref, *refs, H, KVH, D, K, pairs, block_d, eps,
            drop, has_scale, has_bias, mma):
    # slot_ref i32[1]; cos_ref / sin_ref f32[D/2]; x_ref [1, K]; w_lo / w_hi [pairs, K]: this
    # program's two row blocks; norm_ref [K]; [w_scale f32[(H + 2 KVH) D]]; [bias [(H + 2 KVH) D]];
    # k_in / v_in (aliased, not read); q_out [H * D]; k_out / v_out [P * S * KVH * D].
    scale_ref = refs[0] if has_scale else None
    bias_ref = refs[int(has_scale)] if has_bias else None
    q_out, k_out, v_out = refs[-3:]
    f32 = jnp.float32
    dt = dot_dtype(x_ref.dtype, w_lo.dtype)
    per_head = D // 2 // pairs
    i = pl.program_id(0)
    head, j0 = i // per_head, (i % per_head) * pairs
    lo = pl.ds(head * D + j0, pairs)
    hi = pl.ds(head * D + D // 2 + j0, pairs)
    y1, y2 = stream_rows(x_ref, [w_lo, w_hi], norm_ref, prologue="rmsnorm", K=K, block_d=block_d, eps=eps, mma=mma)
    if has_scale:  # an FP8 weight's per-channel scales, before the rounding
        y1, y2 = y1 * scale_ref[lo], y2 * scale_ref[hi]
    y1, y2 = y1.astype(dt), y2.astype(dt)  # the projection's output rounding
    if has_bias:
        y1 = (y1.astype(f32) + bias_ref[lo].astype(f32)).astype(dt)
        y2 = (y2.astype(f32) + bias_ref[hi].astype(f32)).astype(dt)
    c, s = cos_ref[pl.ds(j0, pairs)], sin_ref[pl.ds(j0, pairs)]
    f1, f2 = y1.astype(f32), y2.astype(f32)
    r1, r2 = (f1 * c + (-f2) * s).astype(dt), (f2 * c + f1 * s).astype(dt)  # rope_halves' arithmetic
    slot = slot_ref[0]

    @pl.when(head < H)
    def _():
        q_out[lo] = r1
        q_out[hi] = r2

    def write(ref, kvh, a, b):
        @pl.when(slot < drop)
        def _():
            base = (slot * KVH + kvh) * D + j0
            ref[pl.ds(base, pairs)] = kv_store(a, ref.dtype)  # (an FP8 cache: saturated)
            ref[pl.ds(base + D // 2, pairs)] = kv_store(b, ref.dtype)

    @pl.when((head >= H) & (head < H + KVH))
    def _():
        write(k_out, head - H, r1, r2)

    @pl.when(head >= H + KVH)
    def _():
        write(v_out, head - H - KVH, y1, y2)


def kernel_blocks(F: int, K: int, D: int, dtype):
    """(pairs, block_d, num_warps, num_stages, mma): rows per half-block, so a program
    streams 2 * pairs rows, as many as the projection kernel's tile (fused_linear's
    default_mma_blocks for bf16 / f16, whose dot needs pairs >= 16; else the elementwise
    default_blocks; FP8 weights: its FP8 rows, on the H200 2 x 4 rows x 512 13.1 us against
    21-22 through the tensor-core dot, 2026-11-30, scripts/bench_linear.py --fp8 --sweep),
    both by the whole projection's shape, unless the device's ``qkv_rope_mma`` row takes it
    first (``qkv_rope_fp8_mma`` for FP8: float16 dots; kernels_pallas/tuning.py); None when the
    head cannot be split that way."""
    fp8 = is_fp8(dtype)
    t = device_tuning().qkv_rope_tile(F, K, fp8) if fp8 or jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None
    pairs = _pow2_divisor(F, t.block_f, 32) // 2 if t else 0
    if pairs and (D // 2) % pairs == 0:
        return (pairs, k_block(K, t.block_d), t.num_warps, t.num_stages, True)
    b = None if is_fp8(dtype) else default_mma_blocks(F, K, dtype)  # (FP8: its own rows above only)
    if b is not None and b[0] // 2 >= 16 and (D // 2) % (b[0] // 2) == 0:
        return (b[0] // 2,) + tuple(b[1:])
    b = default_blocks(F, K, fp8=is_fp8(dtype))
    if b is None or b[0] // 2 < 2 or (D // 2) % (b[0] // 2):
        return None
    return (b[0] // 2,) + tuple(b[1:]) + (False,)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "blocks", "interpret"))
def qkv_rope_kv_write_gpu(x, w, norm_w, bias, cos, sin, slot_mapping, k_pages, v_pages, *, num_heads, eps,
                          blocks=None, interpret=False, w_scale=None):
    """The kernel (Pallas, Triton backend) on one token (M = 1); same contract as the
    reference. Caches are updated in place when the caller donates them. blocks: see
    kernel_blocks (its default when None)."""
    P, S, KVH, D = k_pages.shape
    K = w.shape[1]
    H = num_heads
    dt = dot_dtype(x.dtype, w.dtype)
    pairs, bd, warps, stages, mma = blocks or kernel_blocks(w.shape[0], K, D, w.dtype)
    blocks_per_half = D // 2 // pairs  # pair blocks per head
    whole = pl.BlockSpec()

    def rows(offset):  # block index (in units of `pairs` rows) of program i's lo / hi rows
        return lambda i: ((i // blocks_per_half) * 2 * blocks_per_half + offset + i % blocks_per_half, 0)

    inputs = [slot_mapping.astype(jnp.int32), cos.reshape(D // 2), sin.reshape(D // 2), x, w, w, norm_w]
    in_specs = [whole, whole, whole, whole, pl.BlockSpec((pairs, K), rows(0)),
                pl.BlockSpec((pairs, K), rows(blocks_per_half)), whole]
    for a in (w_scale, bias):
        if a is not None:
            inputs.append(a)
            in_specs.append(whole)
    inputs += [k_pages.reshape(-1), v_pages.reshape(-1)]
    in_specs += [whole, whole]
    n = len(inputs)
    q, k, v = pl.pallas_call(
        functools.partial(_kernel, H=H, KVH=KVH, D=D, K=K, pairs=pairs, block_d=bd, eps=eps, drop=P * S,
                          has_scale=w_scale is not None, has_bias=bias is not None, mma=mma),
        grid=((H + 2 * KVH) * blocks_per_half,),
        in_specs=in_specs,
        out_specs=(whole, whole, whole),
        out_shape=(jax.ShapeDtypeStruct((H * D,), dt), jax.ShapeDtypeStruct(inputs[-2].shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(inputs[-1].shape, v_pages.dtype)),
        input_output_aliases={n - 2: 1, n - 1: 2},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"qkv_rope_kv_write_p{pairs}_d{bd}{'_mma' if mma else ''}{'_fp8' if w_scale is not None else ''}",
    )(*inputs)
    return q.reshape(1, H, D), k.reshape(P, S, KVH, D), v.reshape(P, S, KVH, D)


def validate(x, w, norm_w, bias, cos, slot_mapping, k_pages, v_pages, num_heads, w_scale=None):
    P, S, KVH, D = k_pages.shape
    F = (num_heads + 2 * KVH) * D
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if w.ndim != 2 or w.shape[0] != F:
        raise ValueError(f"qkv weight must be [(heads + 2 kv_heads) * head_dim, in] = [{F}, ...], got {w.shape}")
    M, K = x.shape[0], w.shape[1]
    if x.shape != (M, K):
        raise ValueError(f"x must be [tokens, {K}], got {x.shape}")
    if norm_w.shape != (K,):
        raise ValueError(f"norm_w must be [{K}], got {norm_w.shape}")
    if bias is not None and bias.shape != (F,):
        raise ValueError(f"bias must be [{F}], got {bias.shape}")
    if w_scale is not None and (w_scale.shape != (F,) or w_scale.dtype != jnp.float32):
        raise ValueError(f"w_scale must be float32 [{F}], got {w_scale.dtype}{list(w_scale.shape)}")
    if cos.shape != (M, D // 2) or slot_mapping.shape != (M,):
        raise ValueError(f"rope tables must be [{M}, {D // 2}] and slot_mapping [{M}], got {cos.shape}, "
                         f"{slot_mapping.shape}")


def supports(rows: int, w_shape, head_dim: int, dtype) -> bool:
    """The kernel's contract: one token, and a head that splits into the projection's tile
    (kernel_blocks; ``dtype``: the weight's). Whether a model uses it is decided elsewhere (jspec.ops.qkv_kernel)."""
    return rows == 1 and kernel_blocks(w_shape[0], w_shape[1], head_dim, dtype) is not None


def qkv_rope_kv_write(x, w, norm_w, bias, cos, sin, slot_mapping, k_pages, v_pages, *, num_heads, eps,
                      interpret=False, w_scale=None):
    """Public entry: the kernel (ref_qkv_rope_kv_write's arguments and results) on what
    ``supports`` says; ``interpret``: its body in Pallas' interpreter."""
    validate(x, w, norm_w, bias, cos, slot_mapping, k_pages, v_pages, num_heads, w_scale)
    if not supports(x.shape[0], w.shape, k_pages.shape[3], w.dtype):
        raise ValueError(f"qkv_rope_kv_write: the kernel takes one token and a head_dim its tiles split, got "
                         f"{x.shape[0]} tokens, head_dim {k_pages.shape[3]} and a {w.shape} {w.dtype} weight")
    return qkv_rope_kv_write_gpu(x, w, norm_w, bias, cos, sin, slot_mapping, k_pages, v_pages,
                                 num_heads=num_heads, eps=float(eps), interpret=interpret, w_scale=w_scale)
