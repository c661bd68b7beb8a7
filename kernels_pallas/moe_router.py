"""A mixture-of-experts router's choice: softmax over the experts, the top_k, renormalised.

    p = softmax(logits)                       f32 [N, E]
    weights, experts = top_k(p, top_k)        descending; equal values: the lower expert first
    weights = weights / sum(weights)          when norm (Qwen3-MoE's norm_topk_prob)

logits f32[N, E] (the router's projection, which stays with XLA) -> (weights f32[N, top_k],
experts i32[N, top_k]), as jax.nn.softmax then jax.lax.top_k give them.

Why: XLA runs these as a softmax kernel and a sort (lax.top_k lowers to a sort on the GPU),
with a copy: 1.5 + 3.4 + 1.1 us of GPU time per layer at one token of Qwen3-30B-A3B (H100,
jax 0.11.2, 2026-11-27, scripts/step_profile.py): 0.29 ms of a 3.45 ms step, for 128
numbers a layer. This kernel takes 2.3 us, and the step's span fell to 3.27 ms
(docs/bench/2026-11-27_step_profile_moe_h100.log).

Kernel (Pallas, Triton backend): one program per token. The row is padded to a power of
two with -inf (probability 0, after every expert in index order, so a pad is never chosen
while an expert remains); then top_k rounds of: the maximum, the lowest index that holds
it, that entry masked to -1.

Numerics: the reference's formulas in f32 (exp(l - max) / sum, then weight / sum of the
chosen); the sums' order may differ from XLA's, so a probability may differ in its last
bit, and the choice only where two probabilities are that close
(tests/kernels/test_moe_router.py).

``norm_logits``: the logits above for a few tokens in one kernel, from the residual stream
x [N, H] of the layer (the MoE's input norm not applied yet):

    xn = rms_norm(x, norm_w, eps)             x's dtype [N, H] (the experts' input)
    logits = f32(xn @ w.T [+ b])              w [E, H], b [E]; rounded to w's dtype, as a Linear's

Why: through XLA these are four kernels a layer (the norm's sum and product, the router's
dot, its bias and conversion to f32): gpt-oss-20b at one token on the H200
(scripts/step_profile.py, 2026-12-01): 1.3 + 1.2 + 2.4 + 1.2 us of GPU time a layer, and four
of a step's ~340 CUDA graph nodes a layer, whose launch the batch-1 step waits on. A program
(token, experts) loads the token's row, the norm's weight and its experts' rows whole (padded
to a power of two, masked), each in one load: one program a token looping over the width
took 13.9 us (a dependent round trip to memory a step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import rms_norm
from kernels_pallas.paged_attention_gpu import _next_pow2

MAX_EXPERTS = 4096  # one program holds a row of E (padded) f32 values in registers


def ref_router_top_k(logits, *, top_k: int, norm: bool):
    """The jnp reference (and the path on the CPU and the TPU). logits f32[N, E] ->
    (weights f32[N, top_k], experts i32[N, top_k])."""
    validate(logits, top_k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _kernel(l_ref, w_ref, e_ref, *, top_k, norm):
    # l_ref f32[1, Ep] (pads -inf); w_ref f32[1, Kp], e_ref i32[1, Kp] (past top_k: zeros)
    logits = l_ref[...]
    Ep, Kp = logits.shape[1], w_ref.shape[1]
    ex = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    p = ex / jnp.sum(ex, axis=1, keepdims=True)
    idx = lax.broadcasted_iota(jnp.int32, (1, Ep), 1)
    slot = lax.broadcasted_iota(jnp.int32, (1, Kp), 1)
    w = jnp.zeros((1, Kp), jnp.float32)
    e = jnp.zeros((1, Kp), jnp.int32)
    for j in range(top_k):  # static: top_k rounds
        m = jnp.max(p, axis=1, keepdims=True)
        i = jnp.min(jnp.where(p == m, idx, Ep), axis=1, keepdims=True)
        w = jnp.where(slot == j, m, w)
        e = jnp.where(slot == j, i, e)
        p = jnp.where(idx == i, -1.0, p)  # probabilities are >= 0: never the maximum again
    if norm:
        w = w / jnp.sum(w, axis=1, keepdims=True)  # the slots past top_k hold zeros
    w_ref[...] = w
    e_ref[...] = e


@functools.partial(jax.jit, static_argnames=("top_k", "norm", "interpret"))
def router_top_k_gpu(logits, *, top_k: int, norm: bool, interpret: bool = False):
    """The kernel (Pallas, Triton backend), same contract as ref_router_top_k."""
    N, E = logits.shape
    Ep, Kp = _next_pow2(E), _next_pow2(top_k)
    padded = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, Ep - E)), constant_values=-jnp.inf)
    w, e = pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, norm=norm),
        grid=(N,),
        in_specs=[pl.BlockSpec((1, Ep), lambda n: (n, 0))],
        out_specs=(pl.BlockSpec((1, Kp), lambda n: (n, 0)), pl.BlockSpec((1, Kp), lambda n: (n, 0))),
        out_shape=(jax.ShapeDtypeStruct((N, Kp), jnp.float32), jax.ShapeDtypeStruct((N, Kp), jnp.int32)),
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"moe_router_top{top_k}",
    )(padded)
    return w[:, :top_k], e[:, :top_k]


def supports(num_experts: int, top_k: int) -> bool:
    """The kernel's contract: 1 <= top_k <= num_experts <= MAX_EXPERTS."""
    return 1 <= top_k <= num_experts <= MAX_EXPERTS


def validate(logits, top_k: int):
    """logits [N, E] and 1 <= top_k <= E."""
    if logits.ndim != 2:
        raise ValueError(f"router_top_k: logits must be [tokens, experts], got shape {logits.shape}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"router_top_k: top_k={top_k} must be between 1 and the {logits.shape[1]} experts")


def router_top_k(logits, *, top_k: int, norm: bool, interpret: bool = False):
    """Public entry: the kernel (ref_router_top_k's arguments and results), on what
    ``supports`` says; ``interpret``: its body in Pallas' interpreter. logits [N, E]."""
    validate(logits, top_k)
    if not supports(logits.shape[1], top_k):
        raise ValueError(f"router_top_k: the kernel takes at most {MAX_EXPERTS} experts, got {logits.shape[1]}")
    return router_top_k_gpu(logits, top_k=top_k, norm=norm, interpret=interpret)


# ---- the norm and the router's projection for a few tokens, in one kernel ---------------------
LOGITS_MAX_TOKENS = 16  # more tokens: XLA's GEMM (each program here re-reads its experts' rows)
LOGITS_MAX_WIDTH = 8192  # a program holds its rows' products over the whole (padded) width


def ref_norm_logits(x, w, *, norm_w, eps: float, bias=None):
    """The jnp reference: x [N, H], norm_w [H], w [E, H], bias [E] | None -> (xn [N, H] in x's
    dtype, logits f32[N, E]), as rms_norm, then a Linear (its dot rounded to w's dtype, then
    the bias in that dtype), converted to f32."""
    validate_norm_logits(x, w, norm_w, bias)
    xn = rms_norm(x, norm_w, eps).astype(x.dtype)
    logits = jnp.einsum("nh,eh->ne", xn.astype(w.dtype), w)
    if bias is not None:
        logits = logits + bias
    return xn, logits.astype(jnp.float32)


def _norm_logits_kernel(x_ref, nw_ref, w_ref, *refs, H, E, eps, block_e):
    # x_ref [1, H] (the token's), nw_ref [H], w_ref [E, H] (whole), [b_ref [E] (whole)];
    # xn_ref [1, H], l_ref f32[1, block_e] (this program's experts)
    *b_ref, xn_ref, l_ref = refs
    f32, dt, wdt = jnp.float32, xn_ref.dtype, w_ref.dtype
    Hp, e0 = _next_pow2(H), pl.program_id(1) * block_e
    col = lax.broadcasted_iota(jnp.int32, (1, Hp), 1)
    x = plt.load(x_ref.at[pl.ds(0, 1), pl.ds(0, Hp)], mask=col < H, other=0).astype(f32)
    nw = plt.load(nw_ref.at[pl.ds(0, Hp)], mask=col[0] < H, other=0).astype(f32)[None, :]
    rows = e0 + lax.broadcasted_iota(jnp.int32, (block_e, Hp), 0)
    w = plt.load(w_ref.at[pl.ds(e0, block_e), pl.ds(0, Hp)], mask=(rows < E) & (col < H), other=0)  # no wait on x
    r = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / H + eps)
    xn = (nw * (x * r).astype(dt).astype(f32)).astype(dt)  # rms_norm: weight * round(x / rms)

    @pl.when(pl.program_id(1) == 0)
    def _():
        plt.store(xn_ref.at[pl.ds(0, 1), pl.ds(0, Hp)], xn, mask=col < H)

    logits = jnp.sum(w.astype(f32) * xn.astype(wdt).astype(f32), axis=1)[None, :].astype(wdt)  # the Linear's rounding
    if b_ref:
        expert = e0 + lax.broadcasted_iota(jnp.int32, (block_e,), 0)
        b = plt.load(b_ref[0].at[pl.ds(e0, block_e)], mask=expert < E, other=0)
        logits = (logits.astype(f32) + b.astype(f32)[None, :]).astype(wdt)
    l_ref[...] = logits.astype(f32)


def logits_block_e(E: int, H: int) -> int:
    """Experts a program: as many rows as keep its products at 4,096 values over the padded
    width (32 registers a thread at 4 warps); gpt-oss's 2880-wide router: one row a program."""
    return max(1, min(_next_pow2(E), 4096 // _next_pow2(H)))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def norm_logits_gpu(x, w, norm_w, bias, *, eps: float, interpret: bool = False):
    """The kernel (Pallas, Triton backend), same contract as ref_norm_logits."""
    (N, H), E = x.shape, w.shape[0]
    be = logits_block_e(E, H)
    whole = pl.BlockSpec()
    xn, logits = pl.pallas_call(
        functools.partial(_norm_logits_kernel, H=H, E=E, eps=eps, block_e=be),
        grid=(N, pl.cdiv(E, be)),
        in_specs=[pl.BlockSpec((1, H), lambda n, e: (n, 0)), whole, whole] + ([] if bias is None else [whole]),
        out_specs=(pl.BlockSpec((1, H), lambda n, e: (n, 0)), pl.BlockSpec((1, be), lambda n, e: (n, e))),
        out_shape=(jax.ShapeDtypeStruct((N, H), x.dtype), jax.ShapeDtypeStruct((N, pl.cdiv(E, be) * be), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_router_logits",
    )(x, norm_w, w, *([] if bias is None else [bias]))
    return xn, logits[:, :E]


def norm_logits_supports(N: int, H: int) -> bool:
    """The kernel's contract: 1 to LOGITS_MAX_TOKENS tokens, H up to LOGITS_MAX_WIDTH."""
    return 1 <= N <= LOGITS_MAX_TOKENS and H <= LOGITS_MAX_WIDTH


def validate_norm_logits(x, w, norm_w, bias):
    """x [N, H], w [E, H], norm_w [H], bias [E] | None."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"norm_logits: x must be [tokens, H] and the router weight [experts, H], got {x.shape} "
                         f"and {w.shape}")
    if norm_w.shape != (x.shape[1],) or (bias is not None and bias.shape != (w.shape[0],)):
        raise ValueError(f"norm_logits: norm weight {norm_w.shape} and bias {None if bias is None else bias.shape} "
                         f"must be ({x.shape[1]},) and ({w.shape[0]},)")


def norm_logits(x, w, *, norm_w, eps: float, bias=None, interpret: bool = False):
    """Public entry: the kernel (ref_norm_logits' arguments and results), on what
    ``norm_logits_supports`` says; ``interpret``: its body in Pallas' interpreter."""
    validate_norm_logits(x, w, norm_w, bias)
    if not norm_logits_supports(*x.shape):
        raise ValueError(f"norm_logits: the kernel takes 1 to {LOGITS_MAX_TOKENS} tokens of at most "
                         f"{LOGITS_MAX_WIDTH} features, got x {x.shape}")
    return norm_logits_gpu(x, w, norm_w, bias, eps=float(eps), interpret=interpret)
