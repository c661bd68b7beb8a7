"""From the fused qkv projection to attention's inputs in one kernel: split q / k / v,
optional per-head RMSNorm (Qwen3's q_norm / k_norm), rotate-half RoPE on q and k, and the
paged-cache write of k and v (in place).

Why: at batch 1 on the H200 these steps were five XLA kernels per layer (two concatenates
for RoPE, a multiply, a select and the KV scatter, 1.2-2.3 us each, ~7 us per layer or
~0.25 ms per Llama-3.1-8B step; profiler, jax 0.11.2, 2026-11-21), for ~25 KB of data.
The RoPE tables depend only on the positions, so the model computes cos / sin once per
step (rope_tables) and every layer's kernel reads them.

Layout: qkv rows are [q heads | k heads | v heads] x head_dim (the fused projection's
output). The kernel views every head as two half-rows (rows 2h and 2h + 1 of a
[.., D / 2] array), so rotate-half is elementwise between the two loads, and a head of the
cache [P, S, KVH, D] is the half-rows 2 * (slot * KVH + h) and 2 * (slot * KVH + h) + 1.
One program per (token, kv head): the kv head's k and v and its group of H / KVH query
heads, so a token's heads spread over KVH SMs (one program for all of a token's heads took
4.6 us per layer of Qwen3-30B-A3B at batch 1, H100, 2026-11-27, for ~10 KB of data).
Tokens whose slot is P * S (padding) write nothing, like the reference's scatter with
mode="drop".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import rms_norm
from kernels_pallas.paged_attention import kv_store, write_kv
from kernels_pallas.paged_attention_gpu import _next_pow2


def rope_tables(positions, inv_freq):
    """cos, sin f32[..., D/2] of positions (i32[...]) times inv_freq (f32[D/2])."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs), jnp.sin(freqs)


def rope_halves(x, cos, sin):
    """Rotate-half RoPE (HF convention) on x [..., heads, D] with tables [..., D/2]:
    the same products and sums, in f32, as x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c + (-x2) * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """[..., (H + 2 KVH) * D] -> q [..., H, D], k [..., KVH, D], v [..., KVH, D]."""
    lead = qkv.shape[:-1]
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[..., :qs].reshape(lead + (num_heads, head_dim)),
            qkv[..., qs: qs + ks].reshape(lead + (num_kv_heads, head_dim)),
            qkv[..., qs + ks:].reshape(lead + (num_kv_heads, head_dim)))


def ref_rope_kv_write(qkv, cos, sin, slot_mapping, k_pages, v_pages, q_norm_w=None, k_norm_w=None, *,
                      num_heads, eps=1e-6):
    """jnp reference. qkv [M, (H + 2 KVH) * D]; cos, sin f32[M, D/2]; slot_mapping i32[M]
    (P * S: not written); k_pages, v_pages [P, S, KVH, D]; q_norm_w, k_norm_w [D] | None.
    -> (q [M, H, D] after norm and RoPE, k_pages, v_pages)."""
    validate(qkv, cos, slot_mapping, k_pages, v_pages, q_norm_w, k_norm_w, num_heads)
    KVH, D = k_pages.shape[2:]
    q, k, v = split_qkv(qkv, num_heads, KVH, D)
    if q_norm_w is not None:
        q = rms_norm(q, q_norm_w, eps)
        k = rms_norm(k, k_norm_w, eps)
    q, k = rope_halves(q, cos, sin), rope_halves(k, cos, sin)
    return (q, *write_kv(k_pages, v_pages, k, v, slot_mapping))


def _kernel(slot_ref, cos_ref, sin_ref, qkv_ref, *refs, H, KVH, half, drop, eps, has_norm):
    # qkv_ref [M * (H + 2 KVH) * 2, half]: half-rows; cos_ref / sin_ref f32[M * half];
    # then [qn_ref, kn_ref] [D], k_in / v_in (aliased to k_out / v_out, not read),
    # [q_out [M * H * 2, half] (H > 0)], k_out / v_out [P * S * KVH * 2, half].
    if has_norm:
        qn_ref, kn_ref, *refs = refs
    if H:
        _, _, q_out, k_out, v_out = refs
    else:  # k and v only (DFlash's context K/V)
        _, _, k_out, v_out = refs
    m, g = pl.program_id(0), pl.program_id(1)  # token, kv head
    base = m * (H + 2 * KVH)
    G = max(H // KVH, 1)  # query heads per kv head: this program's are g * G ... (g + 1) * G - 1
    c = cos_ref[pl.ds(m * half, half)][None, :]
    s = sin_ref[pl.ds(m * half, half)][None, :]
    dt = qkv_ref.dtype
    # Head indices padded to a power of two (Triton tiles); pads repeat the group's last head,
    # so their (identical) results land on that head's rows.
    hq = g * G + jnp.minimum(jnp.arange(_next_pow2(G), dtype=jnp.int32), G - 1)
    hk = g + jnp.zeros((1,), jnp.int32)

    def load(heads):
        rows = 2 * (base + heads)
        return qkv_ref[rows, :], qkv_ref[rows + 1, :]

    def norm(x1, x2, w_ref):  # rms_norm over the whole head (both halves), HF rounding
        f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        inv = lax.rsqrt((jnp.sum(f1 * f1, axis=1) + jnp.sum(f2 * f2, axis=1)) / (2 * half) + eps)[:, None]
        w1 = w_ref[pl.ds(0, half)].astype(jnp.float32)[None, :]
        w2 = w_ref[pl.ds(half, half)].astype(jnp.float32)[None, :]
        return ((w1 * (f1 * inv).astype(dt).astype(jnp.float32)).astype(dt),
                (w2 * (f2 * inv).astype(dt).astype(jnp.float32)).astype(dt))

    def rope(x1, x2):
        f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return (f1 * c + (-f2) * s).astype(dt), (f2 * c + f1 * s).astype(dt)

    k1, k2 = load(H + hk)
    v1, v2 = load(H + KVH + hk)
    if has_norm:
        k1, k2 = norm(k1, k2, kn_ref)
    k1, k2 = rope(k1, k2)
    if H:
        q1, q2 = load(hq)
        if has_norm:
            q1, q2 = norm(q1, q2, qn_ref)
        q1, q2 = rope(q1, q2)
        qrows = 2 * (m * H + hq)
        q_out[qrows, :] = q1
        q_out[qrows + 1, :] = q2
    slot = slot_ref[m]

    @pl.when(slot < drop)
    def _():
        rows = 2 * (slot * KVH + hk)
        k_out[rows, :] = kv_store(k1, k_out.dtype)  # (an FP8 cache: saturated, paged_attention.kv_store)
        k_out[rows + 1, :] = kv_store(k2, k_out.dtype)
        v_out[rows, :] = kv_store(v1, v_out.dtype)
        v_out[rows + 1, :] = kv_store(v2, v_out.dtype)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "interpret"))
def rope_kv_write_gpu(qkv, cos, sin, slot_mapping, k_pages, v_pages, q_norm_w=None, k_norm_w=None, *,
                      num_heads, eps=1e-6, interpret=False):
    """The kernel (Pallas, Triton backend), same contract as ref_rope_kv_write. The caches
    are updated in place (aliased outputs) when the caller donates them, as the engine's
    jitted step does. num_heads 0: qkv holds k and v only; q comes back [M, 0, D]."""
    M = qkv.shape[0]
    P, S, KVH, D = k_pages.shape
    half = D // 2
    H = num_heads
    has_norm = q_norm_w is not None
    norms = [q_norm_w, k_norm_w] if has_norm else []  # cast to f32 in the kernel: no extra XLA op
    inputs = [slot_mapping.astype(jnp.int32), cos.reshape(M * half), sin.reshape(M * half),
              qkv.reshape(M * (H + 2 * KVH) * 2, half), *norms,
              k_pages.reshape(P * S * KVH * 2, half), v_pages.reshape(P * S * KVH * 2, half)]
    n = len(inputs)
    whole = pl.BlockSpec()
    kv_shapes = [jax.ShapeDtypeStruct(inputs[-2].shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(inputs[-1].shape, v_pages.dtype)]
    q_shape = [jax.ShapeDtypeStruct((M * H * 2, half), qkv.dtype)] if H else []
    out = pl.pallas_call(
        functools.partial(_kernel, H=H, KVH=KVH, half=half, drop=P * S, eps=eps, has_norm=has_norm),
        grid=(M, KVH),
        in_specs=[whole] * n,
        out_specs=tuple(whole for _ in q_shape + kv_shapes),
        out_shape=tuple(q_shape + kv_shapes),
        input_output_aliases={n - 2: len(q_shape), n - 1: len(q_shape) + 1},
        compiler_params=plt.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="rope_kv_write" if H else "rope_kv_write_kv_only",
    )(*inputs)
    q = out[0].reshape(M, H, D) if H else jnp.zeros((M, 0, D), qkv.dtype)
    k, v = out[-2:]
    return q, k.reshape(P, S, KVH, D), v.reshape(P, S, KVH, D)


def unsupported_shape(head_dim: int) -> str | None:
    """Why the kernel cannot take this head_dim (Triton loads half-rows of D / 2 lanes,
    a power of 2), or None."""
    half = head_dim // 2
    return None if half >= 1 and not half & (half - 1) else f"head_dim {head_dim} is not twice a power of 2"


def validate(qkv, cos, slot_mapping, k_pages, v_pages, q_norm_w, k_norm_w, num_heads):
    P, S, KVH, D = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * KVH) * D:
        raise ValueError(f"qkv must be [tokens, (heads + 2 kv_heads) * head_dim] = [M, {(num_heads + 2 * KVH) * D}], "
                         f"got {qkv.shape}")
    if num_heads % KVH:
        raise ValueError(f"num_heads={num_heads} must be a multiple of the {KVH} kv heads (grouped-query attention)")
    M = qkv.shape[0]
    if cos.shape != (M, D // 2):
        raise ValueError(f"rope tables must be [{M}, {D // 2}], got {cos.shape}")
    if slot_mapping.shape != (M,):
        raise ValueError(f"slot_mapping must be [{M}], got {slot_mapping.shape}")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("q_norm_w and k_norm_w go together")


def rope_kv_write(qkv, cos, sin, slot_mapping, k_pages, v_pages, q_norm_w=None, k_norm_w=None, *, num_heads,
                  eps=1e-6, interpret=False):
    """Public entry: the kernel (ref_rope_kv_write's arguments and results) on a head_dim
    that ``unsupported_shape`` passes; ``interpret``: its body in Pallas' interpreter."""
    validate(qkv, cos, slot_mapping, k_pages, v_pages, q_norm_w, k_norm_w, num_heads)
    reason = unsupported_shape(k_pages.shape[-1])
    if reason is not None:
        raise ValueError(f"rope_kv_write: {reason}")
    return rope_kv_write_gpu(qkv, cos, sin, slot_mapping, k_pages, v_pages, q_norm_w, k_norm_w,
                             num_heads=num_heads, eps=float(eps), interpret=interpret)
