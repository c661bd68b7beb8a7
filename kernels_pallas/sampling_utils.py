"""Sampling helpers shared by the rejection sampler, its reference and the drafters.

Everything here is plain jnp so the same integer/float ops run inside Pallas kernels
(GPU Triton, TPU Mosaic, interpret) and in the jnp references, bit for bit.

- `row_key(seed, position, salt)` / `uniform_from_key(key, index)`: a stateless
  counter-based hash RNG (murmur3 fmix32 rounds on int32 with logical shifts; int32
  multiplication wraps exactly like uint32, and int32 is the safest integer type on every
  Pallas backend). `uniform(seed, position, index, salt)` composes the two.
  Outputs lie in [2^-24, 1 - 2^-24]: never 0 (so `u <= p` rejects p == 0) nor 1 (so
  -log(u) > 0 and the Gumbel noise is finite).
- `filter_thresholds(logits, temperature, top_k, top_p)`: the top-k / top-p filter of a
  request expressed as one raw-logit threshold per row (keep `logit >= threshold`).
- `target_probs(logits, temperature, top_k, top_p)`: probabilities after temperature,
  top-k and top-p (one-hot argmax for temperature 0).
- `sample_from_probs(probs, seeds, positions, salt)`: Gumbel-max sample, used by drafters
  with draft_sample_method="probabilistic" (pass a salt different from the verifier's).

Top-k / top-p semantics (vLLM's, with ties at the cut-off kept):
- top_k <= 0 or top_k >= V: off. Otherwise keep logits >= the k-th largest logit.
- top_p >= 1: off. Otherwise, after top-k, keep the smallest prefix of tokens sorted by
  probability whose exclusive cumulative probability is < top_p (the top token is always
  kept), plus any token tied with the last kept one.
Temperature 0 (greedy) ignores top-k and top-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Salts keep the independent random streams apart. The drafter picks its own.
SALT_ACCEPT = 0x5EED_0001  # accept/reject uniform u_i (index 0)
SALT_RACE = 0x5EED_0002  # per-vocab Gumbel noise of the verifier
SALT_DRAFT = 0x5EED_0003  # suggested salt for probabilistic drafting


def _i32(c: int) -> np.int32:
    """A uint32 constant as the int32 with the same bits."""
    return np.array(c & 0xFFFFFFFF, dtype=np.uint32).view(np.int32)


_M1 = _i32(0x85EBCA6B)
_M2 = _i32(0xC2B2AE35)
_GOLDEN = _i32(0x9E3779B9)
_C_POS = _i32(0x27D4EB2F)
_C_IDX = _i32(0x165667B1)


def _fmix32(h):
    """murmur3 finalizer on int32 bits (a bijection with full avalanche)."""
    h = h ^ lax.shift_right_logical(h, jnp.int32(16))
    h = h * _M1
    h = h ^ lax.shift_right_logical(h, jnp.int32(13))
    h = h * _M2
    return h ^ lax.shift_right_logical(h, jnp.int32(16))


def as_i32_bits(x) -> jax.Array:
    """u32 or i32 (array or Python int) -> i32 with the same low 32 bits."""
    if isinstance(x, (int, np.integer)):
        return jnp.asarray(_i32(int(x)))
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        return lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def row_key(seed, position, salt) -> jax.Array:
    """i32 key of one random stream: (seed, position, salt) -> i32 (broadcasting)."""
    seed = as_i32_bits(seed)
    position = as_i32_bits(position)
    salt = as_i32_bits(salt)
    h = _fmix32(seed ^ _fmix32(salt + _GOLDEN))
    return _fmix32(h + position * _C_POS + _GOLDEN)


def uniform_from_key(key, index) -> jax.Array:
    """f32 in (0, 1) for element `index` of the stream `key` (both i32, broadcasting)."""
    h = _fmix32(key ^ (index * _C_IDX))
    h = _fmix32(h + key)
    # 23 random bits + 0.5 ulp: exact in f32 and strictly inside (0, 1).
    bits = lax.shift_right_logical(h, jnp.int32(9))
    return (bits.astype(jnp.float32) + 0.5) * np.float32(2.0**-23)


def uniform(seed, position, index, salt) -> jax.Array:
    """Stateless U(0,1) keyed on (seed, position, index, salt); f32, never 0 or 1."""
    return uniform_from_key(row_key(seed, position, salt), as_i32_bits(index))


def gumbel_from_key(key, index) -> jax.Array:
    """Gumbel(0,1) noise: argmax(log p + g) samples from p (Gumbel-max trick)."""
    return -jnp.log(-jnp.log(uniform_from_key(key, index)))


def first_argmax(x) -> jax.Array:
    """i32 index of the maximum over the last axis, the lowest on ties (jnp.argmax's answer
    for non-NaN input), as a max and a min: two plain reductions, where XLA:CPU runs
    jnp.argmax's variadic (value, index) reduce about twice as slowly."""
    m = jnp.max(x, axis=-1, keepdims=True)
    col = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == m, col, x.shape[-1] - 1), axis=-1)


def _bcast_rows(x, ndim: int):
    """Per-request param [B] -> [B, 1, ..., 1] broadcasting against [B, ..., V]."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def safe_inv_temperature(temperature) -> jax.Array:
    """1/T for sampled requests, 1 for greedy ones (never divides by zero)."""
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0.0
    return jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))


def filter_thresholds(logits, temperature, top_k, top_p, always: bool = False) -> jax.Array:
    """Top-k / top-p as a raw-logit threshold per row: keep `logits >= threshold`.

    logits: f32|bf16[B, ..., V]; temperature f32[B]; top_k i32[B]; top_p f32[B].
    Returns f32[B, ...]; -inf where no filter applies (also for greedy rows). The sort
    over V only runs when some request uses top-k or top-p (lax.cond), or unconditionally
    with always=True (no conditional: on GPU a lax.cond syncs with the host).
    """
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    nd = x.ndim
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    sampled = jnp.asarray(temperature, jnp.float32) > 0.0
    k_on = sampled & (top_k > 0) & (top_k < v)
    p_on = sampled & (top_p < 1.0)
    no_filter = jnp.full(x.shape[:-1], -jnp.inf, jnp.float32)

    def compute(_):
        s_desc = -jnp.sort(-x, axis=-1)  # [B, ..., V] descending
        k = jnp.where(k_on, top_k, v)
        k_idx = _bcast_rows(jnp.clip(k, 1, v) - 1, nd)
        t_k = jnp.take_along_axis(s_desc, jnp.broadcast_to(k_idx, x.shape[:-1] + (1,)), -1)
        keep_k = s_desc >= t_k
        inv_t = _bcast_rows(safe_inv_temperature(temperature), nd)
        z = jnp.where(keep_k, s_desc * inv_t, -jnp.inf)
        p = jax.nn.softmax(z, axis=-1)
        excl = jnp.cumsum(p, axis=-1) - p
        p_lim = _bcast_rows(jnp.where(p_on, top_p, 2.0), nd)
        keep = keep_k & (excl < p_lim)
        n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
        thr = jnp.take_along_axis(s_desc, n_keep - 1, -1)[..., 0]
        on = _bcast_rows(k_on | p_on, nd - 1)
        return jnp.where(on, thr, -jnp.inf)

    if always:
        return compute(None)
    return lax.cond(jnp.any(k_on | p_on), compute, lambda _: no_filter, None)


def target_probs(logits, temperature, top_k, top_p) -> jax.Array:
    """f32[B, ..., V] probabilities after temperature, top-k, top-p.

    logits f32|bf16[B, ..., V]; params [B] broadcast over the leading axis.
    Greedy rows (temperature 0) get a one-hot at argmax (lowest index on ties).
    """
    x = logits.astype(jnp.float32)
    nd = x.ndim
    thr = filter_thresholds(x, temperature, top_k, top_p)[..., None]
    inv_t = _bcast_rows(safe_inv_temperature(temperature), nd)
    z = jnp.where(x >= thr, x * inv_t, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    greedy = jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jnp.where(_bcast_rows(jnp.asarray(temperature) <= 0.0, nd), greedy, p)


def sample_from_probs(probs, seeds, positions, salt) -> jax.Array:
    """i32[B] sample from probs f32[B, V] keyed on (seeds[B], positions[B], salt).

    Gumbel-max over log(probs); zero-probability tokens are never chosen (unless a row is
    all zeros, which returns 0).
    """
    probs = jnp.asarray(probs, jnp.float32)
    if probs.ndim != 2:
        raise ValueError(f"probs must be [B, V], got shape {probs.shape}")
    key = row_key(seeds, positions, salt)[:, None]
    idx = lax.broadcasted_iota(jnp.int32, probs.shape, 1)
    score = jnp.where(probs > 0, jnp.log(probs) + gumbel_from_key(key, idx), -jnp.inf)
    return jnp.argmax(score, axis=-1).astype(jnp.int32)


def host_filtering(temperature, top_k, top_p, v):
    """"auto" -> "on"/"off" when the sampling params are host values (numpy, lists): no
    lax.cond then, which on GPU costs a host sync (~50 us on the H200) per call. Device
    arrays and tracers keep "auto" (decided on the device)."""
    params = (temperature, top_k, top_p)
    if any(isinstance(x, (jax.Array, jax.core.Tracer)) for x in params):
        return "auto"
    t, k, p = (np.asarray(x) for x in params)
    used = np.any((t > 0) & (((k > 0) & (k < v)) | (p < 1)))
    return "on" if used else "off"
