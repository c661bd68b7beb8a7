"""Few-token mixture-of-experts on MXFP4 experts (gpt-oss as shipped): each (token, expert)
pair's expert MLP, the packed weights streamed in place and dequantized in the kernel.

    y[p] = down_e(act) [+ b_down[e]],  act = swiglu(gate_up_e(x[p // top_k]) [+ b_gate_up[e]])

for the pairs p of tokens x [N, H] and their chosen experts (experts i32[N * top_k],
token-major); ``swiglu`` is kernels_pallas/moe_experts.swiglu (gpt-oss's clamped form with
``limit`` > 0). The weights as jspec/mxfp4.py holds them, HF's [out, in] per expert:
gate_up blocks u8[E, 2I, G, 16] and scales u8[E, 2I, G] (gate rows, then up rows; G = H / 32),
down blocks u8[E, H, GI, 16] and scales u8[E, H, GI] (GI = I / 32). A weight is
fp4(code) * 2^(scale - 127), value 2j of a block in the low nibble of its byte j, 2j + 1 in
the high one. -> y [N * top_k, H] in x's dtype.

Why: gpt-oss-120b's experts are ~61 GB packed and ~230 GB in bf16; at batch 1 a token reads
4 experts a layer, and the bytes-per-token bound counts them at 4.25 bits a weight. Streaming
them packed reads 3.8x fewer bytes than bf16 weights would. XLA's way (the reference below:
gather the pairs' experts, dequantize, dot) reads them packed too only if XLA fuses the
dequantization into its dots: scripts/bench_moe_mxfp4.py measures both (H200, one token: XLA's
way 402 us, these kernels 40 in ops.moe's whole call).

Kernels (Pallas, Triton backend), two calls, each program one pair and ``block_f`` rows of
its expert, looping over the row's blocks of 32 values ``block_g`` at a time (the last step
masked: gpt-oss's G = 2880 / 32 = 90 has no large power-of-two divisor):
  1. grid (pairs, I / block_f): the pair's gate and up rows against x's even and odd values
     (read through a [..., 2] view of x: each byte's two nibbles meet them without an
     interleave), f32 accumulation, the scale applied per block; bias and SwiGLU -> act [P, I];
  2. grid (pairs, H / block_f): the down rows against act's even and odd values; bias -> y;
     or, given the pairs' weights [N, top_k] (and a residual [N, H]), grid (tokens, H / block_f),
     on the CUDA-core stream: a token's pairs' rows streamed together, each pair's rows as
     above, then summed as moe_experts.combine_pairs [+ the residual] -> [N, H] (jspec.ops.moe's batch-1 decode: the
     XLA fusion of that sum goes; at one token of gpt-oss-20b 15.0 us against 12.4 for the
     pairs apart and that fusion's 1.35, one CUDA graph node a layer fewer).
Two streams of a program's rows: on CUDA cores (``_row_stream``, up to ``use_mma``'s pair count,
and for float32 activations: PTX decodes each byte and forms its two products, each step's
loads are issued a step ahead) and through float16 tensor-core dots (``_row_stream_mma``:
codes decoded by PTX, each block's sum kept apart by a block-diagonal activation operand). In
interpret mode the codes are decoded by ``fp4_as_f16`` (bits moved into a float16's, converted).
H200, gpt-oss-20b's layer, the kernels alone (scripts/bench_moe_mxfp4.py, raw
docs/bench/2026-12-01_moe_mxfp4_{paths,cuda_stream}_h200.log): at one token the CUDA-core
stream 46.5 us before this design (a decode of 3 integer ops a value into f32 bits, the
products left to XLA's lowering unfused, the even / odd split in 4 XLA slices of 1 us each),
33.3 us with it (its bytes 12.0; the loads alone, no math, 19-25 us of kernels at these
tiles; the rest is instructions: Nsight Compute finds issue slots 60-66% busy); at 2 / 8
tokens 61.5 / 223.3 against the tensor cores' 62.0 / 177.3; at 32, 617 on tensor cores.
Tiles: kernels_pallas/tuning.py (``moe_mxfp4``, ``moe_mxfp4_mma``).

Numerics: the weights exact in f32 (an FP4 value times a power of two), f32 accumulation,
each projection rounded to x's dtype, then the bias and the SwiGLU op by op in that
dtype, as the reference's XLA ops: equal to it up to the order of the f32 sums
(tests/kernels/test_moe_experts_mxfp4.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import _pow2_divisor, silu_mul_rounded
from kernels_pallas.moe_experts import combine_pairs, ref_moe_experts
from kernels_pallas.tuning import device_tuning

BLOCK = 32  # values a scale covers


def dequantize(blocks, scales, dtype):
    """u8[..., G, 16] blocks and u8[..., G] scales -> [..., G * 32] in ``dtype`` (exact)."""
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[:-1] + (BLOCK,))
    values = fp4_values(codes.astype(jnp.int32)) * power_of_two(scales.astype(jnp.int32))[..., None]
    return values.reshape(blocks.shape[:-2] + (-1,)).astype(dtype)


def fp4_values(codes):
    """i32 e2m1 codes (0..15) -> f32 values: the magnitude t = code & 7 is 0.5 t below 4,
    else t - 2 (6 for t = 7); bit 3 the sign."""
    t = codes & 7
    tf = t.astype(jnp.float32)
    mag = jnp.where(t < 4, 0.5 * tf, jnp.where(t == 7, 6.0, tf - 2.0))
    return jnp.where(codes >= 8, -mag, mag)


def fp4_as_f16(blk):
    """i32 bytes [...] -> (low nibble's values, high nibble's), f32 [...] each, times 2^-14:
    an e2m1 code's bits moved into a float16's (sign to bit 15; exponent and mantissa bits to
    bits 10-11 and 9, so that the code's exponent is the float16's, biased by 15 where e2m1's
    bias is 1: 2^-14 apart, its subnormal 0.5 included), converted exactly. Five integer ops a
    value where ``fp4_values`` takes eleven: the kernels decode 2.4 G values a gpt-oss-20b
    token. The block scale's power of two then carries the 2^14."""
    to_f32 = lambda bits: lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)  # noqa: E731
    lo = lax.shift_left(blk & 0x08, 12) | lax.shift_left(blk & 0x07, 9)
    hi = lax.shift_left(blk & 0x80, 8) | lax.shift_left(blk & 0x70, 5)
    return to_f32(lo), to_f32(hi)


# The PTX decode's shifts (both paths'): a line moves two nibbles of four packed bytes into the
# two float16 halves of a register, the sign to bit 15 (of each half) and the exponent and
# mantissa bits to 9-11: (shift of the sign, shift of the magnitude; negative: right) for the
# low nibbles of bytes 0 and 2, of bytes 1 and 3, then the high nibbles' likewise.
_NIBBLE_SHIFTS = {"lo": ((12, 9), (4, 1)), "hi": ((8, 5), (0, -3))}


def _f16_bits(src: str, dst: str, sign: int, mag: int) -> str:
    """One line of PTX: ``dst`` = the two float16 bit patterns of a nibble pair of ``src``."""
    a = f"shl.b32 a, {src}, {sign}; and.b32 a, a, 0x80008000;" if sign else f"and.b32 a, {src}, 0x80008000;"
    b = f"shl.b32 b, {src}, {mag};" if mag > 0 else f"shr.b32 b, {src}, {-mag};"
    return f"{a} {b} and.b32 b, b, 0x0E000E00; or.b32 {dst}, a, b;"


# The CUDA-core path's decode and products on the GPU, in PTX: each byte's two nibbles moved into
# float16 bits (as fp4_as_f16: the value times 2^-14), two values a 32-bit register, converted to
# f32 (cvt.f32.f16 runs as a full-rate add on the FMA pipe), and the byte's two products formed,
# lo * even + hi * odd (mul + fma): four bytes in 19 integer ops, 8 conversions and 8 floating
# ops, where moving each code into an f32's bits took 3 integer ops a value and XLA's lowering
# left the products unfused. At one token the kernels are instruction-bound (H200, Nsight
# Compute: issue slots 60-66% busy, the integer pipe the busiest); the module docstring has the
# times. Lanes: a register's low half holds bytes 0-1, its high half bytes 2-3.
_PAIR_ASM = "\n".join([
    "{", ".reg .b32 a, b, c, d, e, f;", ".reg .b16 l0, l1, l2, l3, h0, h1, h2, h3;",
    ".reg .f32 p0, p1, p2, p3, q0, q1, q2, q3;",
    *(_f16_bits("$4", dst, *sh) for dst, sh in zip("cdef", _NIBBLE_SHIFTS["lo"] + _NIBBLE_SHIFTS["hi"])),
    "mov.b32 {l0, l2}, c; mov.b32 {l1, l3}, d; mov.b32 {h0, h2}, e; mov.b32 {h1, h3}, f;",
    "cvt.f32.f16 p0, l0; cvt.f32.f16 p1, l1; cvt.f32.f16 p2, l2; cvt.f32.f16 p3, l3;",
    "cvt.f32.f16 q0, h0; cvt.f32.f16 q1, h1; cvt.f32.f16 q2, h2; cvt.f32.f16 q3, h3;",
    *(f"mul.f32 p{i}, p{i}, ${5 + i}; fma.rn.f32 ${i}, q{i}, ${9 + i}, p{i};" for i in range(4)),
    "}"])


def fp4_pair_products(blk, lo, hi, asm: bool):
    """u8 bytes [..., 16] against f32 vectors lo / hi [..., 16] (broadcast over the leading
    dims) -> f32 [..., 16]: each byte's low-nibble value times lo plus its high-nibble value
    times hi, times 2^-14. asm: the PTX above (the GPU); else fp4_as_f16 (interpret mode)."""
    lo, hi = jnp.broadcast_to(lo, blk.shape), jnp.broadcast_to(hi, blk.shape)
    if asm:
        return plt.elementwise_inline_asm(_PAIR_ASM, args=[blk, lo, hi], constraints="=r,=r,=r,=r" + ",r" * 9,
                                          pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(blk.shape, jnp.float32)])[0]
    w_lo, w_hi = fp4_as_f16(blk.astype(jnp.int32))
    return w_lo * lo + w_hi * hi


def power_of_two(scales):
    """i32 biased exponents s (0..255) -> f32 2^(s - 127), the exponent field itself (exact;
    s = 0 gives 0, where 2^-127 is a subnormal: a block of such weights is all but zero)."""
    return lax.bitcast_convert_type(lax.shift_left(scales, 23), jnp.float32)


def ref_moe_experts_mxfp4(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, *, top_k: int,
                          b_gate_up=None, b_down=None, limit: float = 0.0, alpha: float = 1.702, weights=None,
                          residual=None):
    """The jnp reference: each pair's expert gathered still packed, dequantized to x's dtype,
    then moe_experts.ref_moe_experts; with weights [N, top_k] (and residual [N, H]) each
    token's pairs combined (moe_experts.combine_pairs) -> [N, H]. Shapes in the module
    docstring."""
    validate(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, top_k, weights, residual)
    pairs = jnp.arange(experts.shape[0])
    take = lambda a: None if a is None else a[experts]  # noqa: E731
    gu = dequantize(gu_blocks[experts], gu_scales[experts], x.dtype)
    dn = dequantize(down_blocks[experts], down_scales[experts], x.dtype)
    xs = jnp.repeat(x, top_k, axis=0)  # pair p's token, so that pair p reads row p of the gathered experts
    y = ref_moe_experts(xs, pairs, gu, dn, top_k=1, b_gate_up=take(b_gate_up), b_down=take(b_down), limit=limit,
                        alpha=alpha)
    return y if weights is None else combine_pairs(y, weights, residual=residual)


def validate(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, top_k: int, weights=None, residual=None):
    N, H = x.shape
    if (weights is not None and weights.shape != (N, top_k)) or (residual is not None and (
            weights is None or residual.shape != (N, H))):
        raise ValueError(f"moe_experts_mxfp4: weights {None if weights is None else weights.shape} and residual "
                         f"{None if residual is None else residual.shape} must be [N, top_k] = ({N}, {top_k}) and "
                         f"[N, H] = ({N}, {H}), the residual only with weights")
    E, I2 = gu_blocks.shape[:2]
    I = I2 // 2
    want = {"gu_blocks": (E, I2, H // BLOCK, BLOCK // 2), "gu_scales": (E, I2, H // BLOCK),
            "down_blocks": (E, H, I // BLOCK, BLOCK // 2), "down_scales": (E, H, I // BLOCK)}
    got = {"gu_blocks": gu_blocks.shape, "gu_scales": gu_scales.shape, "down_blocks": down_blocks.shape,
           "down_scales": down_scales.shape}
    bad = [k for k in want if tuple(got[k]) != want[k]]
    if H % BLOCK or I2 % (2 * BLOCK) or bad or experts.shape != (N * top_k,):
        raise ValueError(f"moe_experts_mxfp4: x {x.shape}, experts {experts.shape} (top_k {top_k}) and the packed "
                         f"weights {got} do not fit [N, H], [N top_k], [E, 2I, H / 32, 16], [E, 2I, H / 32], "
                         f"[E, H, I / 32, 16], [E, H, I / 32] (H and I multiples of 32)")
    for k, a in zip(want, (gu_blocks, gu_scales, down_blocks, down_scales)):
        if a.dtype != jnp.uint8:
            raise ValueError(f"moe_experts_mxfp4: {k} must be uint8, got {a.dtype}")


def _row_stream(blk_ref, sc_ref, v_ref, rows, G, block_f, block_g, asm, leads=None):
    """(f32[block_f], ...): for each of ``rows`` (pl.ds's of the stacked rows, as many as a
    program streams: gate_up's gate and up blocks), those packed rows (blk_ref u8[E R, G, 16],
    sc_ref u8[E R, G]) times the vector v_ref [G, 16, 2] (a block's 16 bytes against its 16
    even and 16 odd values), over G blocks, ``block_g`` a step (the last masked), in one loop:
    each step's activations loaded once for all of them. Step i + 1's loads are issued before
    step i's math (carried in the loop), so that their latency hides behind it; each (row,
    block) sum takes its scale once, after its 16 lanes are added. asm: the PTX of
    fp4_pair_products (the GPU), else fp4_as_f16. leads: each row's vector, as leading indices
    into v_ref (a block of several: down's summed pairs, streamed together; one indexer a load,
    all Triton's lowering takes); None: one vector for all."""
    f32 = jnp.float32
    leads = ((),) * len(rows) if leads is None else tuple(leads)
    keys = list(dict.fromkeys(leads))  # the distinct vectors, and each row's among them
    key_of = [keys.index(lead) for lead in leads]

    def loads(i):  # step i's activations, packed rows and scales (past G masked: no traffic)
        g0 = i * block_g
        live = lambda shape, axis: g0 + lax.broadcasted_iota(jnp.int32, shape, axis) < G  # noqa: E731
        gs = pl.ds(g0, block_g)
        vec = tuple(tuple(plt.load(v_ref.at[(*map(jnp.int32, lead), gs, slice(None), jnp.int32(k))],
                                   mask=live((block_g, 16), 0), other=0.0) for k in (0, 1)) for lead in keys)
        blks = tuple(plt.load(blk_ref.at[r, gs, :], mask=live((block_f, block_g, 16), 1), other=0) for r in rows)
        scs = tuple(plt.load(sc_ref.at[r, gs], mask=live((block_f, block_g), 1), other=0) for r in rows)
        return vec, blks, scs

    def body(i, carry):
        accs, (vecs, blks, scs) = carry
        nxt = loads(i + 1)
        vecs = [tuple(v.astype(f32) for v in vec) for vec in vecs]
        out = []
        for acc, blk, sc, key in zip(accs, blks, scs, key_of):
            lo, hi = vecs[key]
            part = jnp.sum(fp4_pair_products(blk, lo[None], hi[None], asm), axis=2)  # [block_f, block_g], x 2^-14
            out.append(acc + part * power_of_two(sc.astype(jnp.int32) + 14))
        return tuple(out), nxt

    accs, _ = lax.fori_loop(0, pl.cdiv(G, block_g), body,
                            (tuple(jnp.zeros((block_f, block_g), f32) for _ in rows), loads(0)))
    return tuple(jnp.sum(a, axis=1) for a in accs)


# The tensor-core path's decode on the GPU: PTX moving each byte's nibbles into float16 bits
# (the value times 2^-14, as fp4_as_f16), two values a 32-bit register, as _PAIR_ASM without
# its conversions and products: four bytes (Triton packs them into one register) -> four
# low-nibble values (11 ops) or four high-nibble ones (10). prmt orders the bytes 0, 2, 1, 3 so
# that a register's two float16 halves are consecutive elements.
_F16_ASM = {k: "\n".join(["{", ".reg .b32 r, a, b;", "prmt.b32 r, $2, 0, 0x3120;",
                             *(_f16_bits("r", f"${i}", *sh) for i, sh in enumerate(_NIBBLE_SHIFTS[k])), "}"])
            for k in ("lo", "hi")}
MMA_X_SHIFT = 4  # the activations enter the float16 dot times 2^-4: exact for bf16 values in [2^-13, 2^20)


def fp4_f16(blk, asm: bool):
    """u8 bytes [...] -> (low nibbles' values, high nibbles'), float16 [...] each, times 2^-14
    (exact). asm: the PTX above (the GPU); else fp4_as_f16 (interpret mode)."""
    if asm:
        sds = jax.ShapeDtypeStruct(blk.shape, jnp.float16)
        # one output an asm: Pallas' lowering of a two-output elementwise_inline_asm fails (jax 0.11.2)
        return tuple(plt.elementwise_inline_asm(_F16_ASM[k], args=[blk], constraints="=r,=r,r", pack=4,
                                                result_shape_dtypes=[sds])[0] for k in ("lo", "hi"))
    return tuple(v.astype(jnp.float16) for v in fp4_as_f16(blk.astype(jnp.int32)))


def _row_stream_mma(blk_ref, sc_ref, v_ref, rows, G, block_f, block_g, asm):
    """_row_stream through tensor cores, one vector for all rows: blk_ref u8[E R, G 16],
    sc_ref u8[E R, G], v_ref [G 16, 2] (flat: a byte's even and odd value). A step's packed
    rows [block_f, block_g 16] decoded to float16 go through one dot with a block-diagonal
    [block_g 16, block_g] operand (column g holds block g's activations, zeros elsewhere), so
    that each (row, block) sum comes out apart and takes its block's scale: f32 [block_f,
    block_g] accumulated, summed over blocks at the end."""
    f32, f16 = jnp.float32, jnp.float16
    W = block_g * 16  # bytes of a row a step
    iota = lambda shape, d: lax.broadcasted_iota(jnp.int32, shape, d)  # noqa: E731
    diag = iota((W, block_g), 0) // 16 == iota((W, block_g), 1)

    def body(i, accs):
        c0, g0 = i * W, i * block_g
        live = lambda shape, axis, start, end: start + iota(shape, axis) < end  # noqa: E731  (past G: no traffic)
        xs = [plt.load(v_ref.at[pl.ds(c0, W), jnp.int32(k)], mask=live((W,), 0, c0, G * 16), other=0.0).astype(f32)
              * f32(2.0**-MMA_X_SHIFT) for k in (0, 1)]
        X_lo, X_hi = (jnp.where(diag, x.astype(f16)[:, None], jnp.zeros((), f16)) for x in xs)
        out = []
        for r, acc in zip(rows, accs):
            blk = plt.load(blk_ref.at[r, pl.ds(c0, W)], mask=live((block_f, W), 1, c0, G * 16), other=0)
            sc = plt.load(sc_ref.at[r, pl.ds(g0, block_g)], mask=live((block_f, block_g), 1, g0, G),
                          other=0).astype(jnp.int32)
            w_lo, w_hi = fp4_f16(blk, asm)
            part = plt.dot(w_lo, X_lo) + plt.dot(w_hi, X_hi)  # [block_f, block_g], times 2^-(14 + MMA_X_SHIFT)
            out.append(acc + part * power_of_two(sc + 14 + MMA_X_SHIFT))
        return tuple(out)

    accs = lax.fori_loop(0, pl.cdiv(G, block_g), body, tuple(jnp.zeros((block_f, block_g), f32) for _ in rows))
    return tuple(jnp.sum(a, axis=1) for a in accs)


def swiglu_rounded(g, u, dtype, limit: float, alpha: float):
    """moe_experts.swiglu op by op on f32 values of ``dtype`` numbers, each result rounded
    to ``dtype`` as XLA's ops are. -> f32 (of ``dtype`` numbers)."""
    rnd = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
    if not limit:
        return rnd(silu_mul_rounded(g, u, dtype))
    g = jnp.minimum(g, limit)
    sig = rnd(1.0 / (1.0 + jnp.exp(-rnd(g * alpha))))
    return rnd(rnd(jnp.clip(u, -limit, limit) + 1.0) * rnd(g * sig))


def _gate_up_kernel(idx_ref, v_ref, blk_ref, sc_ref, b_ref, o_ref, *, I, G, block_f, block_g, limit, alpha, asm,
                    stream):
    # idx_ref i32[P]; v_ref [G, 16, 2] (the pair's token); blk_ref u8[E 2I, G, 16], sc_ref
    # u8[E 2I, G], b_ref [E 2I] (whole); o_ref [1, I]. (The tensor-core stream's v_ref and
    # blk_ref are flat: [G 16, 2], [E 2I, G 16].)
    p, j = pl.program_id(0), pl.program_id(1)
    row = idx_ref[p] * (2 * I) + j * block_f
    dt, f32 = o_ref.dtype, jnp.float32
    rnd = lambda a: a.astype(dt).astype(f32)  # noqa: E731
    g, u = (rnd(y) for y in stream(blk_ref, sc_ref, v_ref, (pl.ds(row, block_f), pl.ds(row + I, block_f)),
                                    G, block_f, block_g, asm))
    g, u = rnd(g + b_ref[pl.ds(row, block_f)].astype(f32)), rnd(u + b_ref[pl.ds(row + I, block_f)].astype(f32))
    o_ref[0, pl.ds(pl.multiple_of(j * block_f, block_f), block_f)] = swiglu_rounded(g, u, dt, limit, alpha).astype(dt)


def _down_kernel(idx_ref, v_ref, blk_ref, sc_ref, b_ref, *refs, H, G, block_f, block_g, asm, stream, top_k):
    # idx_ref i32[P]; v_ref [G, 16, 2] (the pair's act); blk_ref u8[E H, G, 16], sc_ref
    # u8[E H, G], b_ref [E H] (whole); o_ref [1, H]. top_k > 0 (the pairs combined): the
    # program is token n's, v_ref [top_k, G, 16, 2] its pairs' acts, refs = (wt_ref [N top_k]
    # (whole), res_ref [1, H] | absent, o_ref): moe_experts.combine_pairs over its rows.
    p, j = pl.program_id(0), pl.program_id(1)
    o_ref = refs[-1]
    dt, f32 = o_ref.dtype, jnp.float32
    rnd = lambda a: a.astype(dt).astype(f32)  # noqa: E731
    cols = pl.ds(pl.multiple_of(j * block_f, block_f), block_f)

    pairs = [p] if not top_k else [p * top_k + s for s in range(top_k)]
    rows = [idx_ref[q] * H + j * block_f for q in pairs]  # each pair's expert's rows
    tiles = tuple(pl.ds(r, block_f) for r in rows)
    if top_k:  # the pairs streamed together, each against its own act (the CUDA-core stream)
        ys = _row_stream(blk_ref, sc_ref, v_ref, tiles, G, block_f, block_g, asm, [(s,) for s in range(top_k)])
    else:
        ys = stream(blk_ref, sc_ref, v_ref, tiles, G, block_f, block_g, asm)
    ys = [rnd(rnd(y) + b_ref[pl.ds(r, block_f)].astype(f32)) for y, r in zip(ys, rows)]  # + b_down[e]
    if not top_k:
        o_ref[0, cols] = ys[0].astype(dt)
        return
    acc = jnp.zeros((block_f,), f32)
    for q, y in zip(pairs, ys):  # in pair order, as combine_pairs sums; the weight rounded to dt
        acc = acc + rnd(y * rnd(refs[0][q].astype(f32)))
    out = rnd(acc)
    if len(refs) == 3:
        out = rnd(refs[1][0, cols].astype(f32) + out)
    o_ref[0, cols] = out.astype(dt)


def default_blocks(I: int, H: int, mma: bool = False):
    """(block_f, block_g, num_warps, num_stages) for experts [2I, H] / [H, I], or None where
    no row tile divides I and H: the device's ``moe_mxfp4`` row (``moe_mxfp4_mma`` for the
    tensor-core path; kernels_pallas/tuning.py), block_f shrunk to a power of two dividing
    both (at least 16, a dot's rows, on the tensor-core path)."""
    tuning = device_tuning()
    bf, bg, warps, stages = tuning.moe_mxfp4_mma if mma else tuning.moe_mxfp4
    bf = _pow2_divisor(math.gcd(I, H), bf, 16 if mma else 8)
    return (bf, bg, warps, stages) if bf else None


def use_mma(pairs: int, I: int, H: int, dtype) -> bool:
    """The tensor-core path from the device's ``moe_mxfp4_mma_min_pairs`` pairs up (below, the
    CUDA-core path is as fast or faster), for bf16 / float16 activations (float32 ones would
    lose bits in the float16 dot), where its tile divides I and H."""
    return pairs >= device_tuning().moe_mxfp4_mma_min_pairs and \
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and \
        default_blocks(I, H, mma=True) is not None


def supports(x_shape, gu_blocks_shape) -> bool:
    """The kernels' contract: tiles that divide I and H, and stacked rows addressable with
    int32 element offsets."""
    E, I2, G, _ = gu_blocks_shape
    H = x_shape[-1]
    return H == G * BLOCK and I2 % (2 * BLOCK) == 0 and E * I2 * G * 16 < 2**31 and \
        default_blocks(I2 // 2, H) is not None


@functools.partial(jax.jit, static_argnames=("top_k", "limit", "alpha", "interpret", "blocks", "mma"))
def moe_experts_mxfp4_gpu(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, b_gate_up, b_down,
                          weights=None, residual=None, *, top_k: int, limit: float = 0.0, alpha: float = 1.702,
                          interpret: bool = False, blocks=None, mma: bool | None = None):
    """The two kernels; b_gate_up [E, 2I] and b_down [E, H] (zeros where a model has none);
    weights [N, top_k] (and residual [N, H]): down's programs are a token's, each summing its
    pairs' rows (moe_experts.combine_pairs) -> [N, H], on the CUDA-core stream (jspec.ops.moe
    sums there only at its pair counts: on tensor cores, 4x fewer programs); mma: the
    tensor-core path (_row_stream_mma), None for use_mma (without weights); blocks: (block_f,
    block_g, num_warps, num_stages) or None for default_blocks."""
    (_, I2, G, _), P, H = gu_blocks.shape, experts.shape[0], x.shape[1]
    I, GI = I2 // 2, down_blocks.shape[2]
    if mma and weights is not None:
        raise ValueError("moe_experts_mxfp4: the pairs summed in down (weights) stream on CUDA cores, not mma")
    mma = (weights is None and use_mma(P, I, H, x.dtype)) if mma is None else mma
    bf, bg, warps, stages = blocks or default_blocks(I, H, mma)
    # The kernels read a vector's even and odd values (a byte's two nibbles meet them) through
    # a view of it as [..., 2]; the tensor-core stream reads the packed rows and vectors flat.
    if mma:
        stream, rows = _row_stream_mma, (lambda a: a.reshape(-1, a.shape[2] * a.shape[3]))
        vec = lambda a, G_: a.reshape(a.shape[0], G_ * 16, 2)  # noqa: E731
    else:
        stream, rows = _row_stream, (lambda a: a.reshape((-1,) + a.shape[2:]))
        vec = lambda a, G_: a.reshape(a.shape[0], G_, 16, 2)  # noqa: E731

    def call(kernel, owner, n, name, v, codes, scales, bias, per=1, extra=()):
        # one of the two kernels -> [P / per, n]: a program per (owner of ``per`` vectors, row tile)
        lead = (None,) if per == 1 else (per,)
        vec_block = pl.BlockSpec(lead + v.shape[1:], lambda p, j: (owner(p),) + (0,) * (v.ndim - 1))
        extra_specs = [pl.BlockSpec(), pl.BlockSpec((1, n), lambda p, j: (p, 0))][:len(extra)]
        return pl.pallas_call(
            kernel, grid=(P // per, n // bf),
            in_specs=[pl.BlockSpec(), vec_block] + [pl.BlockSpec()] * 3 + extra_specs,
            out_specs=pl.BlockSpec((1, n), lambda p, j: (p, 0)),
            out_shape=jax.ShapeDtypeStruct((P // per, n), x.dtype),
            compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=interpret, name=f"moe_mxfp4_{name}_f{bf}_g{bg}" + ("_mma" if mma else ""),
        )(experts, v, rows(codes), scales.reshape(-1, scales.shape[2]), bias.reshape(-1), *extra)

    act = call(functools.partial(_gate_up_kernel, I=I, G=G, block_f=bf, block_g=bg, limit=limit, alpha=alpha,
                                 asm=not interpret, stream=stream),
               lambda p: p // top_k, I, "gate_up", vec(x, G), gu_blocks, gu_scales, b_gate_up)
    down = functools.partial(_down_kernel, H=H, G=GI, block_f=bf, block_g=bg, asm=not interpret, stream=stream)
    if weights is None:
        return call(functools.partial(down, top_k=0), lambda p: p, H, "down", vec(act, GI), down_blocks, down_scales,
                    b_down)
    extra = (weights.reshape(-1),) + (() if residual is None else (residual,))  # weights rounded to x's dtype there
    return call(functools.partial(down, top_k=top_k), lambda n: n, H, "down_sum", vec(act, GI), down_blocks,
                down_scales, b_down, per=top_k, extra=extra)  # a block of top_k vectors: token n's pairs


def moe_experts_mxfp4(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, *, top_k: int, b_gate_up=None,
                      b_down=None, limit: float = 0.0, alpha: float = 1.702, weights=None, residual=None,
                      interpret: bool = False):
    """Public entry: the kernels (ref_moe_experts_mxfp4's arguments and result), on what
    ``supports`` says; ``interpret``: their bodies in Pallas' interpreter."""
    validate(x, experts, gu_blocks, gu_scales, down_blocks, down_scales, top_k, weights, residual)
    if not supports(x.shape, gu_blocks.shape):
        raise ValueError(f"moe_experts_mxfp4: no kernel tile divides experts {gu_blocks.shape} over x {x.shape}")
    E, I2 = gu_blocks.shape[:2]
    b_gate_up = jnp.zeros((E, I2), x.dtype) if b_gate_up is None else b_gate_up
    b_down = jnp.zeros((E, x.shape[1]), x.dtype) if b_down is None else b_down
    return moe_experts_mxfp4_gpu(x, experts.astype(jnp.int32), gu_blocks, gu_scales, down_blocks, down_scales,
                                 b_gate_up, b_down, weights, residual, top_k=top_k, limit=float(limit),
                                 alpha=float(alpha), interpret=interpret)
