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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

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
