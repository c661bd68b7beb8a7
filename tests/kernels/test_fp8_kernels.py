"""FP8 weights (per output channel) streamed by the batch-1 and verification projection
kernels (fused_linear.py, fused_linear_rows.py, qkv_rope_kv_write.py) on CPU, in Pallas'
interpreter:

- the reference (ref_fused_linear with ``w_scale``) == the dot with the dequantized weight
  (w * scale in float32), within the output's rounding;
- each kernel on FP8 weights == the same kernel on those FP8 values as bf16 weights with the
  scale applied to its f32 output, bit for bit (the FP8 tile enters the same dot exactly),
  and == the reference within bf16's tolerance (fused_linear_rows at tiles given: by default
  FP8 weights take XLA's dots at 2-16 rows);
- a decoder on per-channel FP8 weights with the kernels (decode and verification widths) ==
  the same decoder through XLA's ops.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.layers import rope_inv_freq
from jspec.models.transformer import Transformer
from jspec.ops import plan_kernels, plan_params
from jspec.quantization import FP8, QuantWeight, quantize_fp8
from kernels_pallas.fused_linear import fused_linear, fused_linear_gpu, ref_fused_linear
from kernels_pallas.fused_linear_rows import fused_linear_rows, fused_linear_rows_gpu, ref_fused_linear_rows
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write_gpu, ref_qkv_rope_kv_write
from kernels_pallas.rope_kv_write import rope_kv_write, rope_tables
from tests.kernels.test_fused_linear import TINY, decoder_case, f32, linear_inputs, rel

BF16 = jnp.bfloat16


def fp8(w):
    """(FP8 values [F, K], their per-channel scale f32[F]) of a weight."""
    q = quantize_fp8(w, None, "bfloat16")
    return q.w, q.scale.reshape(-1)


def test_reference_is_the_dequantized_dot():
    x, w, kw = linear_inputs(11, 96, 256, "rmsnorm", BF16, bias=True, residual=True)
    w8, s = fp8(w)
    got = ref_fused_linear(x, w8, w_scale=s, **kw)
    deq = w8.astype(jnp.float32) * s[:, None]
    h = ref_fused_linear(x, jnp.eye(256, dtype=BF16), prologue="rmsnorm", norm_w=kw["norm_w"], eps=1e-5)
    want = kw["residual"].astype(jnp.float32) + (jnp.einsum("...d,fd->...f", h.astype(jnp.float32), deq)
                                                 + kw["bias"].astype(jnp.float32))
    assert got.dtype == BF16 and rel(got, want) < 1e-2
    with pytest.raises(ValueError, match="takes a w_scale"):
        ref_fused_linear(x, w8, **kw)
    with pytest.raises(ValueError, match="w_scale must be float32 of shape"):
        ref_fused_linear(x, w8, w_scale=s[:8], **kw)
    with pytest.raises(ValueError, match="takes no w_scale"):
        ref_fused_linear(x, w, w_scale=s, **kw)


@pytest.mark.parametrize("blocks", [(32, 128, 4, 4, True), (8, 128, 4, 2)])  # tensor-core / elementwise stream
@pytest.mark.parametrize("prologue", ["rmsnorm", "silu_mul", "none"])
def test_one_row_kernel(prologue, blocks):
    x, w, kw = linear_inputs(12, 96, 256, prologue, BF16)
    w8, s = fp8(w)
    got = fused_linear_gpu(x[0], w8, kw.get("norm_w"), prologue=prologue, eps=1e-5, blocks=blocks, interpret=True,
                           w_scale=s)
    same = fused_linear_gpu(x[0], w8.astype(BF16), kw.get("norm_w"), prologue=prologue, eps=1e-5, blocks=blocks,
                            interpret=True, out_dtype="float32")
    np.testing.assert_array_equal(f32(got), f32((same * s).astype(BF16)))
    assert rel(got, ref_fused_linear(x[0], w8, w_scale=s, **kw)) < 2e-2
    # with a bias and a residual, through the public entry
    x, w, kw = linear_inputs(13, 96, 256, prologue, BF16, bias=True, residual=True)
    w8, s = fp8(w)
    got = fused_linear(x, w8, w_scale=s, interpret=True, blocks=blocks, **kw)
    assert got.dtype == BF16 and rel(got, ref_fused_linear(x, w8, w_scale=s, **kw)) < 2e-2


def test_one_row_tensor_core_stream_hands_the_norm_over():
    """o_proj's one row on an FP8 weight through the float16 tensor-core stream (the 70B's o
    takes it: tuning.linear_fp8_mma) with the residual and the next norm handed over == the
    reference: h, h * next_norm_w and the sum of h^2."""
    x, w, kw = linear_inputs(16, 128, 256, "none", BF16, residual=True)
    w8, s = fp8(w)
    nw = (1 + 0.1 * jax.random.normal(jax.random.PRNGKey(17), (128,))).astype(BF16)
    got = fused_linear(x, w8, w_scale=s, interpret=True, blocks=(32, 128, 4, 4, True), next_norm_w=nw, **kw)
    want = ref_fused_linear(x, w8, w_scale=s, next_norm_w=nw, **kw)
    for a, b in zip((got[0], got[1], got[2].sum(-1)), (want[0], want[1], want[2].sum(-1))):
        assert a.shape == b.shape and rel(a, b) < 2e-2


def test_one_row_tiles_of_the_70b():
    """The H200's rows for Llama-3.3-70B's FP8 one-row projections (the CPU's default):
    gate_up, qkv and o through float16 dots, down split over K, qkv + RoPE + KV write 2 x 64
    rows through float16 dots; the 8B's shapes keep theirs."""
    from kernels_pallas.fused_linear import one_row_blocks
    from kernels_pallas.fused_linear_split_k import split_k_blocks
    from kernels_pallas.qkv_rope_kv_write import kernel_blocks
    assert one_row_blocks(57344, 8192, FP8, BF16) == (128, 256, 4, 4, True)
    assert one_row_blocks(28672, 8192, FP8, BF16) == (128, 256, 4, 3, True)  # its tp-2 shard: the 8B's row
    assert one_row_blocks(10240, 8192, FP8, BF16) == (128, 256, 4, 5, True)
    assert one_row_blocks(8192, 8192, FP8, BF16) == (64, 512, 4, 4, True)
    assert split_k_blocks(8192, 28672, FP8, BF16) == (4, 128, 256, 4, 3, True)
    assert kernel_blocks(10240, 8192, 128, FP8) == (64, 256, 4, 4, True)
    assert one_row_blocks(28672, 4096, FP8, BF16) == (128, 256, 4, 3, True)
    assert one_row_blocks(4096, 4096, FP8, BF16)[-1] is False and kernel_blocks(6144, 4096, 128, FP8)[-1] is False


def test_tensor_core_stream_holds_large_activations():
    """The FP8 tensor-core stream's dot runs in float16 with h times 2^-F16_SHIFT: activations
    past float16's range (6.5e4) come out right, and the widest FP8 weight at one row takes
    the kernel even with nothing to fuse (ops.linear_kernel), the narrower ones not."""
    from jspec.ops import GPU, KernelPlan, linear_kernel
    x, w, kw = linear_inputs(14, 96, 256, "none", BF16)
    x = (x[0].astype(jnp.float32) * 2e5).astype(BF16)
    w8, s = fp8(w)
    got = fused_linear_gpu(x, w8, blocks=(32, 128, 4, 4, True), interpret=True, w_scale=s)
    want = ref_fused_linear(x, w8, w_scale=s)
    assert bool(jnp.all(jnp.isfinite(f32(got)))) and rel(got, want) < 2e-2
    from kernels_pallas.fused_linear import default_mma_blocks, one_row_blocks
    assert default_mma_blocks(28672, 4096, FP8) == (128, 256, 4, 3, True)  # the H200's row (the CPU's default)
    assert default_mma_blocks(6144, 4096, FP8) is None
    assert one_row_blocks(28672, 4096, FP8, jnp.float32)[-1] is False  # f32 activations: elementwise
    plan = KernelPlan(linear=GPU())
    assert linear_kernel(plan, 1, (28672, 4096), fused=False, dtype=FP8)
    assert not linear_kernel(plan, 1, (28672, 4096), fused=False, dtype=BF16)
    assert not linear_kernel(plan, 1, (6144, 4096), fused=False, dtype=FP8)
    assert not linear_kernel(plan, 4, (28672, 4096), fused=False, dtype=FP8)


@pytest.mark.parametrize("epilogue", ["bias_residual", "norm_in_handoff", "swiglu"])
def test_rows_kernel(epilogue):
    R, F, K = 5, 128, 256
    ks = jax.random.split(jax.random.PRNGKey(14), 6)
    x = jax.random.normal(ks[0], (R, K)).astype(BF16)
    w8, s = fp8((0.05 * jax.random.normal(ks[1], (F, K))).astype(BF16))
    kw = {}
    if epilogue == "bias_residual":
        kw = dict(bias=(0.1 * jax.random.normal(ks[2], (F,))).astype(BF16),
                  residual=jax.random.normal(ks[3], (R, F)).astype(BF16))
    elif epilogue == "norm_in_handoff":
        kw = dict(sumsq=jnp.abs(jax.random.normal(ks[4], (R, 3))) * 100,
                  residual=jax.random.normal(ks[3], (R, F)).astype(BF16), next_norm_w=(1 + 0.1 * jax.random.normal(ks[5], (F,))).astype(BF16))
    else:
        kw = dict(swiglu=True)
    blocks = (16, 128, 4, 2)
    got = fused_linear_rows(x, w8, w_scale=s, blocks=blocks, interpret=True, eps=1e-5, **kw)
    want = ref_fused_linear_rows(x, w8, w_scale=s, eps=1e-5, **kw)
    if isinstance(got, tuple):  # (y, y * next_norm_w, partial sums of y^2: per program in the kernel)
        got, want = (*got[:2], got[2].sum(-1)), (*want[:2], want[2].sum(-1))
    for a, b in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
        assert a.shape == b.shape and a.dtype == b.dtype and rel(a, b) < 2e-2
    if epilogue == "norm_in_handoff":  # bit for bit: the FP8 stream against the same values as bf16
        same = fused_linear_rows_gpu(x, w8.astype(BF16), sumsq=kw["sumsq"], eps=1e-5, blocks=blocks, interpret=True,
                                     out_dtype="float32")
        mine = fused_linear_rows_gpu(x, w8, sumsq=kw["sumsq"], eps=1e-5, blocks=blocks, interpret=True, w_scale=s)
        np.testing.assert_array_equal(f32(mine), f32((same * s).astype(BF16)))


def test_qkv_rope_kv_write_kernel():
    """norm + qkv + RoPE + KV write on an FP8 weight == the one-row FP8 projection kernel then
    the RoPE + KV-write kernel, bit for bit, and == the reference within bf16's tolerance."""
    H, KVH, D, P, S, K = 4, 2, 32, 6, 8, 256
    ks = jax.random.split(jax.random.PRNGKey(15), 6)
    x = (2 * jax.random.normal(ks[0], (1, K))).astype(BF16)
    w8, s = fp8((0.05 * jax.random.normal(ks[1], ((H + 2 * KVH) * D, K))).astype(BF16))
    nw = (1 + 0.1 * jax.random.normal(ks[2], (K,))).astype(BF16)
    b = (0.1 * jax.random.normal(ks[3], (w8.shape[0],))).astype(BF16)
    kp, vp = (jax.random.normal(k, (P, S, KVH, D)).astype(BF16) for k in ks[4:6])
    cos, sin = rope_tables(jnp.array([29]), rope_inv_freq(TINY.rope, D))
    slot = jnp.array([19], jnp.int32)
    args = (x, w8, nw, b, cos, sin, slot, kp, vp)
    for blocks in ((16, 128, 4, 4, True), (4, 128, 4, 4, False)):
        q1, k1, v1 = qkv_rope_kv_write_gpu(*args, num_heads=H, eps=1e-5, blocks=blocks, interpret=True, w_scale=s)
        qkv = fused_linear_gpu(x, w8, nw, b, prologue="rmsnorm", eps=1e-5, blocks=blocks, interpret=True, w_scale=s)
        q2, k2, v2 = rope_kv_write(qkv, cos, sin, slot, kp, vp, num_heads=H, eps=1e-5, interpret=True)
        for a, c in ((q1, q2), (k1, k2), (v1, v2)):
            np.testing.assert_array_equal(f32(a), f32(c))
        q3, k3, v3 = ref_qkv_rope_kv_write(*args, num_heads=H, eps=1e-5, w_scale=s)
        assert q1.dtype == BF16 and rel(q1, q3) < 1e-2 and rel(k1, k3) < 1e-2 and rel(v1, v3) < 1e-2


@pytest.mark.parametrize("qk_norm,Q", [(False, 1), (True, 1), (False, 4)])
def test_decoder_on_fp8_weights_with_the_kernels(qk_norm, Q):
    """A decoder whose projections are per-channel FP8 (QuantWeight leaves, as the loader
    makes them): the kernels' plan (linear_impl="interpret": fused projections at one row,
    qkv + RoPE + KV write for Llama's layer, the post-attention norm handed over; XLA's dots
    at 4 rows) == XLA's ops, hidden states, logits and the written KV."""
    cfg = dataclasses.replace(TINY, qk_norm=qk_norm)
    kv, meta, tok, params = decoder_case(cfg, Q, 16)

    def quantize(path, a):
        proj = len(path) >= 2 and path[-2].key.endswith("_proj") and path[-1].key == "weight"
        return quantize_fp8(a, None, "bfloat16") if proj else a

    params = jax.tree_util.tree_map_with_path(quantize, params)
    n_fp8 = sum(isinstance(a, QuantWeight) for a in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantWeight)))
    assert n_fp8 == 4 * cfg.num_layers and params["layers_0"]["attn"]["o_proj"]["weight"].w.dtype == FP8
    outs = {}
    for impl in ("reference", "interpret"):
        plan = plan_kernels(cfg, attn_impl="reference", linear_impl=impl, backend="cpu")
        m, p = Transformer(cfg, dtype=BF16, plan=plan), plan_params(plan, params)
        h, _, kv2 = m.apply({"params": p}, tok, meta, kv)
        outs[impl] = (h, m.apply({"params": p}, h, method=Transformer.logits), kv2)
    (h0, l0, kv0), (h1, l1, kv1) = outs["reference"], outs["interpret"]
    assert rel(h1, h0) < 3e-2 and rel(l1, l0) < 3e-2
    for a, b in zip(kv0.k + kv0.v, kv1.k + kv1.v):
        assert rel(b, a) < 3e-2
    # the FP8 weights went through the kernels (their names in the traced program), not XLA's dots
    kernels = set(re.findall(r"(?:fused_linear|qkv_rope_kv_write)\w*_fp8\w*", str(jax.make_jaxpr(
        lambda p: m.apply({"params": p}, tok, meta, kv))(p))))
    if Q == 1:
        qkv = "fused_linear_rmsnorm" if qk_norm else "qkv_rope_kv_write"
        wanted = [qkv, "fused_linear_none_.*_norm_out", "fused_linear_silu_mul"]  # qkv, o (norm handed over), down
        assert all(any(re.search(w, k) for k in kernels) for w in wanted), kernels
    else:  # 2-16 rows: XLA's dots (fused_linear_rows.supports: faster there on the H200)
        assert not kernels, kernels


def test_fp8_activations_reference():
    """W8A8 (ref_fused_linear's x_fp8, vLLM's dynamic per-token FP8 activations): the dot's
    input quantized per row to e4m3 (scale max|x| / 448, values clipped and rounded to
    nearest) and dotted with the FP8 weight, both scales on the f32 result == that maths in
    float64 (numpy, ml_dtypes' e4m3 rounding); within e4m3's rounding of the weight-only
    result; a weight that is not e4m3 is refused."""
    from kernels_pallas.fused_linear import quantize_rows
    from tests.helpers.fp8 import per_token_fp8

    _, w, kw = linear_inputs(5, 96, 256, "rmsnorm", BF16, bias=True)
    x = (2 * jax.random.normal(jax.random.PRNGKey(6), (2, 4, 256))).astype(BF16)
    x = x.at[1, 3].set(0)  # a row of zeros: its scale's floor, no NaN
    kw["residual"] = jax.random.normal(jax.random.PRNGKey(7), (2, 4, 96)).astype(BF16)
    w8, s = fp8(w)
    got = ref_fused_linear(x, w8, w_scale=s, x_fp8=True, **{**kw, "out_dtype": None})
    h = f32(ref_fused_linear(x, jnp.eye(256, dtype=BF16), prologue="rmsnorm", norm_w=kw["norm_w"], eps=1e-5))
    hq, xs = per_token_fp8(h)
    want = (hq @ np.asarray(w8, np.float64).T) * xs * np.asarray(s, np.float64) + np.asarray(kw["bias"], np.float64)
    want = want + np.asarray(kw["residual"], np.float64)
    assert got.dtype == BF16 and np.all(np.isfinite(f32(got)))
    np.testing.assert_allclose(f32(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    weight_only = ref_fused_linear(x, w8, w_scale=s, **kw)
    assert 1e-3 < rel(got, weight_only) < 3e-2  # the activations' e4m3 rounding, no more
    q, sc = quantize_rows(h)
    np.testing.assert_array_equal(f32(q), hq)  # the same e4m3 values, every one
    assert q.dtype == FP8 and sc.shape == (2, 4, 1) and float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0
    with pytest.raises(ValueError, match="x_fp8 .* takes an e4m3 weight"):
        ref_fused_linear(x, w8.astype(jnp.float8_e5m2), w_scale=s, x_fp8=True, **kw)


@pytest.mark.parametrize("rows", [16, 17, 64])
def test_fp8_gemm_plan(rows):
    """Under a plan with fp8_gemm (plan_kernels sets it on a GPU with FP8 tensor cores for a
    checkpoint with FP8 activations) an FP8 weight's XLA dot of more than FP8_GEMM_MIN_ROWS
    bf16 rows is W8A8 (an FP8 x FP8 dot in the traced program, == the x_fp8 reference), of
    fewer weight-only; float32 activations and unquantized weights never quantize."""
    from jspec import ops

    k = jax.random.split(jax.random.PRNGKey(rows), 3)
    x = jax.random.normal(k[0], (rows, 256)).astype(BF16)
    w = (0.05 * jax.random.normal(k[1], (96, 256))).astype(BF16)
    kw = dict(residual=jax.random.normal(k[2], (rows, 96)).astype(BF16))
    q = quantize_fp8(w, None, "bfloat16")
    plan = dataclasses.replace(plan_kernels(TINY, attn_impl="reference", linear_impl="reference", backend="cpu"),
                               in_out_weights=False, fp8_gemm=True)
    w8a8 = rows > ops.FP8_GEMM_MIN_ROWS

    def f8_dots(fn, *args):
        eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
        return [e for e in eqns if e.primitive.name == "dot_general"
                and all(v.aval.dtype == FP8 for v in e.invars)]

    fn = lambda x, q: ops.linear(plan, x, q, residual=kw["residual"])  # noqa: E731
    assert len(f8_dots(fn, x, q)) == int(w8a8)
    want = ref_fused_linear(x, q.w, w_scale=q.scale.reshape(-1), residual=kw["residual"], x_fp8=w8a8)
    np.testing.assert_array_equal(f32(fn(x, q)), f32(want))
    assert not f8_dots(fn, x.astype(jnp.float32), q)
    assert not f8_dots(lambda x, w: ops.linear(plan, x, w), x, w)


def test_fp8_gemms_in_compiled_programs():
    """The GPU check's detector of FP8 GEMMs in a compiled program's text
    (tests/helpers/gpu_lines.fp8_gemms): a cuBLASLt FP8 custom call and a dot of two FP8
    operands count (operands typed inline or by their computation's instructions); XLA:CPU's
    dot after converting FP8 values, a bf16 dot, or an f8 name in another computation do not."""
    from tests.helpers.gpu_lines import fp8_gemms

    cublas = ('  %cublas-lt-matmul.2 = (bf16[256,4096]{1,0}, s8[33554432]{0}) custom-call(%a, %b, %c, %d), '
              'custom_call_target="__cublas$lt$matmul$f8", backend_config={}')
    triton = ("%gemm_fusion_dot.1_computation (p0: f8e4m3fn[256,14336], p1: f8e4m3fn[4096,14336]) -> f32[256,4096] {\n"
              "  %p0 = f8e4m3fn[256,14336]{1,0} parameter(0)\n  %p1 = f8e4m3fn[4096,14336]{1,0} parameter(1)\n"
              "  ROOT %dot.3 = f32[256,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}\n}")
    inline = "  %dot.4 = f32[2,3]{1,0} dot(f8e4m3fn[2,8]{1,0} %x, f8e4m3fn[3,8]{1,0} %y), lhs_contracting_dims={1}"
    other = "%c2 {\n  %p0 = bf16[256,14336]{1,0} parameter(0)\n  ROOT %dot.5 = f32[1]{0} dot(%p0, %p1)\n}"
    assert fp8_gemms(cublas) == ["__cublas$lt$matmul$f8"]
    assert fp8_gemms(triton) == ["%dot.3"] and fp8_gemms(inline) == ["%dot.4"]
    assert fp8_gemms(triton.replace("%p1 = f8e4m3fn", "%p1 = bf16") + "\n\n" + other) == []
    x = jnp.ones((32, 64), FP8)
    w = jnp.ones((48, 64), FP8)
    cpu = jax.jit(lambda x, w: jnp.einsum("md,fd->mf", x, w, preferred_element_type=jnp.float32))
    assert fp8_gemms(cpu.lower(x, w).compile().as_text()) == []  # XLA:CPU converts them first
