"""Rejection sampling for speculative decoding (standard Leviathan and synthetic).

Public API
----------
rejection_sample(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p,
                 seeds, positions, *, method="standard", synthetic_rates=None, kernels=None,
                 filtering="auto")
    -> (tokens i32[B, K+1] padded with -1, num_emitted i32[B])
    kernels: gpu_kernels(interpret=..., <tuning>) | tpu_kernels(interpret=...) | None (jnp)
ref_rejection_sample(...): same signature minus kernels and filtering, pure jnp.
The GPU and TPU kernels (per-block statistics of the logits) are in
kernels_pallas/rejection_blocks.py; this file holds the contract, the reference, the
shared jnp draw and the jitted wrapper. Helpers: kernels_pallas/sampling_utils.py,
synthetic-rate conversions in kernels_pallas/synthetic.py. Which kernels the engine runs:
jspec/ops.py (rejection_sample).

Design
------
The accept decisions of a request are sequential, but every per-row quantity they need
is not. Row i of request b (position positions[b] + i) needs, over the vocabulary:
  - greedy rows: argmax of the raw logits (ties -> lowest index, like jnp.argmax);
  - sampled rows: z = logit / T over the allowed set (logit >= the row's top-k/top-p
    threshold), p = softmax(z), p(d_i), and one token drawn from p (bonus row), from p with
    the draft zeroed (recovered token, q one-hot) or from max(p - q, 0) (recovered token
    with draft probs).
Sampling is a two-level inverse CDF over fixed vocabulary blocks of SAMPLE_BLOCK tokens
(2048, or the largest power of two <= V): pick block b with probability W_b / sum W using
u1, then a token inside block b with probability w_j / W_b using an independent u2. This
is an exact draw from w, and it needs no random number per vocabulary entry: the heavy
part is a reduction over V that reads the logits once (per block: max, sum-exp, sum-exp
without the draft, or the argmax for greedy rows), which is what the kernels do. The
small part (combine the block sums, pick a block, gather its SAMPLE_BLOCK logits, cumsum)
is shared jnp on [B, K+1, V / SAMPLE_BLOCK] and [B, K+1, SAMPLE_BLOCK] arrays.
Why not a Gumbel/exponential race: it needs a hashed uniform and two logs per vocabulary
entry; on the H200 that made the kernel compute-bound at 6% of HBM bandwidth.
Why two levels rather than one flat inverse CDF: the in-block draw is computed by the same
jnp code on the same gathered logits in the kernel path and in the reference, so the two
can differ only through the block sums (float summation order differs between a Triton
reduction and XLA's): a flip needs u1 within a few ulps of one of ~V / 2048 block
boundaries, instead of one of V token boundaries.
With draft probs the residual needs the global max and normaliser first, so a second
kernel pass reads logits and q for the residual rows (R_b = sum max(p - q, 0) per block).
If the residual (or the draft-excluded distribution) has no mass, the row falls back to a
draw from p (vLLM does the same).

Top-k / top-p need a sort over V. It is done in jnp outside the kernel and reduced to one
raw-logit threshold per row, so the kernel still reads only logits (no materialised
probability buffer). Whether to sort (`filtering`): decided on the host when the sampling
params are host values, else by a lax.cond on the device -- which on GPU reads its
predicate on the host: ~50 us per call on the H200, half the kernel time at B=64, K=7
(scripts/bench_rejection.py). Callers that know (filtering="off"/"on") skip it: the engine
decides it per step on the host (a static jit argument). The kernels have no all-greedy fast
path for the same reason; the jnp path has one behind a lax.cond on the CPU only.

Random numbers: a stateless int32 hash (sampling_utils) keyed on (seed, position, salt):
u1, u2 per row for the draw and u_i for the accept test, so results do not depend on batch
composition or on the kernel's tiling.

GPU lowering: Pallas Triton backend (plt.CompilerParams). Why Triton and not Mosaic GPU:
the kernel is a streaming row reduction (masked selects, max / sum / argmax-by-min-index
over 1-D blocks, one program per (row, block)); the Triton lowering supports exactly this
op mix with no layout work, while Mosaic GPU targets warpgroup/TMA matmul pipelines and its
reduction coverage is narrower. Triton is deprecated in jax 0.11 but still runs on the H200
(jax 0.11.2); the same kernel body runs under interpret=True in CI, so only the lowering
itself is untested off-GPU. To avoid masked out-of-bounds loads the last block is shifted
to end at V and its columns already covered by the previous block are masked out.
TPU lowering: Mosaic TPU, grid (B, blocks), one (K+1, SAMPLE_BLOCK) tile per program
(SAMPLE_BLOCK is a multiple of 128 once V >= 128; smaller V is one full-width tile); the
ragged last block is masked by column index. Tested under pltpu.InterpretParams().
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import sampling_utils as su
from kernels_pallas.rejection_blocks import (  # noqa: F401  (re-exported: tests and scripts reach them here)
    _BIG,
    _BONUS,
    _GREEDY,
    _NEG_INF,
    _PAD,
    _RESIDUAL,
    SAMPLE_BLOCK,
    BlockKernels,
    _greedy_math,
    _poison_inputs,
    _resid_gpu,
    _resid_math,
    _resid_tpu,
    _sampled_math,
    _stats_gpu,
    _stats_tpu,
    gpu_kernels,
    num_blocks,
    sample_block,
    tpu_kernels,
)
from kernels_pallas.sampling_utils import host_filtering  # noqa: F401 (re-exported: the engine's import)

# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------


def _validate(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
              top_p, seeds, positions, method, synthetic_rates):
    def shp(x):
        return tuple(np.shape(x))

    def dt(x):
        return jnp.result_type(x)

    if len(shp(target_logits)) != 3:
        raise ValueError(f"target_logits must be [B, K+1, V], got shape {shp(target_logits)}")
    b, k1, v = shp(target_logits)
    k = k1 - 1
    if not jnp.issubdtype(dt(target_logits), jnp.floating):
        raise ValueError(f"target_logits must be f32 or bf16, got {dt(target_logits)}")
    if k1 < 1 or v < 1:
        raise ValueError(f"target_logits needs K+1 >= 1 rows and V >= 1, got {shp(target_logits)}")
    expect = {
        "draft_tokens": (draft_tokens, (b, k), "integer"),
        "num_draft": (num_draft, (b,), "integer"),
        "temperature": (temperature, (b,), "floating"),
        "top_k": (top_k, (b,), "integer"),
        "top_p": (top_p, (b,), "floating"),
        "seeds": (seeds, (b,), "integer"),
        "positions": (positions, (b,), "integer"),
    }
    for name, (x, shape, kind) in expect.items():
        if shp(x) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (B={b}, K={k} from target_logits "
                f"{shp(target_logits)}), got {shp(x)}")
        want = jnp.integer if kind == "integer" else jnp.floating
        if not jnp.issubdtype(dt(x), want):
            raise ValueError(f"{name} must be {kind}, got dtype {dt(x)}")
    if draft_probs is not None:
        if shp(draft_probs) != (b, k, v):
            raise ValueError(f"draft_probs must be None or [B, K, V] = {(b, k, v)}, got {shp(draft_probs)}")
        if not jnp.issubdtype(dt(draft_probs), jnp.floating):
            raise ValueError(f"draft_probs must be floating, got {dt(draft_probs)}")
    if method not in ("standard", "synthetic"):
        raise ValueError(f"method must be 'standard' or 'synthetic', got {method!r}")
    if method == "synthetic":
        if synthetic_rates is None:
            raise ValueError("method='synthetic' needs synthetic_rates (f32[K] conditional rates)")
        if shp(synthetic_rates) != (k,):
            raise ValueError(f"synthetic_rates must have shape (K,) = ({k},), got {shp(synthetic_rates)}")
    elif synthetic_rates is not None:
        raise ValueError("synthetic_rates is only valid with method='synthetic'")


# ----------------------------------------------------------------------------------------
# Shared prologue (plain jnp on [B, K+1] sized arrays)
# ----------------------------------------------------------------------------------------


def _row_params(target_logits, draft_tokens, num_draft, temperature, top_k, top_p, seeds,
                positions, filtering="auto"):
    """Per-row parameters.

    Returns d i32[B, K+1] (draft at row i, -1 where absent), mode i32[B, K+1],
    key i32[B, K+1] (the row's draw RNG stream), inv_t f32[B, K+1], thr f32[B, K+1].
    """
    b, k1, _ = target_logits.shape
    k = k1 - 1
    i = jnp.arange(k1, dtype=jnp.int32)[None, :]
    n = jnp.clip(num_draft.astype(jnp.int32), 0, k)[:, None]
    d = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], 1)
    d = jnp.where(i < n, d, -1)
    greedy = (temperature <= 0.0)[:, None]
    mode = jnp.where(i > n, _PAD, jnp.where(greedy, _GREEDY, jnp.where(i < n, _RESIDUAL, _BONUS)))
    pos = positions.astype(jnp.int32)[:, None] + i
    key = su.row_key(su.as_i32_bits(seeds)[:, None], pos, su.SALT_RACE)
    inv_t = jnp.broadcast_to(su.safe_inv_temperature(temperature)[:, None], (b, k1))
    if filtering == "off":  # the caller guarantees no request uses top-k / top-p
        thr = jnp.full((b, k1), _NEG_INF, jnp.float32)
    else:
        thr = su.filter_thresholds(target_logits, temperature, top_k, top_p, always=filtering == "on")
    return d, mode.astype(jnp.int32), key, inv_t, thr


# ----------------------------------------------------------------------------------------
# Per-block statistics: the block math (shared by the kernel bodies) and its jnp reference
# ----------------------------------------------------------------------------------------




def _blocked(x, fill):
    """[..., V] -> [..., NB, bv], padded with `fill` past V."""
    v = x.shape[-1]
    bv, nb = sample_block(v), num_blocks(v)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, nb * bv - v)]
    return jnp.pad(x, pad, constant_values=fill).reshape(x.shape[:-1] + (nb, bv))


def _ref_block_stats(x, d, mode, inv_t, thr):
    """Per (row, block): a f32 (greedy: block max of the logits; sampled: block max of z),
    s f32 (sum exp(z - a)), sx f32 (the same without the draft), gi i32 (greedy: argmax
    column). Each [B, K+1, NB]; padding rows get (-inf, 0, 0, 0)."""
    v = x.shape[-1]
    xb = _blocked(x.astype(jnp.float32), _NEG_INF)
    col = _blocked(jnp.arange(v, dtype=jnp.int32), _BIG)
    c = lambda t: t[..., None, None]  # noqa: E731  [B, K+1] -> [B, K+1, 1, 1]
    g_max, g_idx = (r[..., 0] for r in _greedy_math(xb, col, col < v))
    m_b, s_b, sx_b = (r[..., 0] for r in _sampled_math(xb, col, col < v, c(d), c(inv_t), c(thr)))
    greedy, sampled = (mode == _GREEDY)[..., None], (mode >= _BONUS)[..., None]
    a = jnp.where(greedy, g_max, jnp.where(sampled, m_b, _NEG_INF))
    return (a, jnp.where(sampled, s_b, 0.0), jnp.where(sampled, sx_b, 0.0),
            jnp.where(greedy, g_idx, 0).astype(jnp.int32))


def _ref_block_resid(x, q, mode, inv_t, thr, m, s):
    """Per (row, block) residual mass sum max(p - q, 0) f32[B, K, NB] (RESIDUAL rows only).
    x [B, K, V] (the draft rows), q [B, K, V]; m, s f32[B, K] the row's global max/normaliser."""
    xb = _blocked(x.astype(jnp.float32), _NEG_INF)
    qb = _blocked(q.astype(jnp.float32), 0.0)
    c = lambda t: t[..., None, None]  # noqa: E731
    z = jnp.where(xb >= c(thr), xb * c(inv_t), _NEG_INF)
    r = jnp.maximum(jnp.exp(z - c(m)) / c(s) - qb, 0.0)
    return jnp.where((mode == _RESIDUAL)[..., None], jnp.sum(r, axis=-1), 0.0)


# ----------------------------------------------------------------------------------------
# Shared selection: block sums -> tokens (plain jnp on [B, K+1, NB] / [B, K+1, bv] arrays)
# ----------------------------------------------------------------------------------------


def _pick(w, u):
    """Inverse CDF: the index j with cum[j-1] <= u * total < cum[j] (w >= 0, [..., n])."""
    cum = jnp.cumsum(w, axis=-1)
    t = u * cum[..., -1]
    return jnp.minimum(jnp.sum(cum <= t[..., None], axis=-1), w.shape[-1] - 1).astype(jnp.int32)


def _draw(x, q, d, kind, blk, m, s, inv_t, thr, u2):
    """The in-block draw: token from block `blk` [B, K+1] of each row, by weight kind
    (0: p, 1: p without the draft, 2: max(p - q, 0)). The same code serves the kernel path
    and the reference, on the same gathered logits."""
    v = x.shape[-1]
    bv = sample_block(v)
    j0 = blk * bv
    start = jnp.minimum(j0, v - bv)  # the shifted last block, as in the GPU kernel
    col = start[..., None] + jnp.arange(bv, dtype=jnp.int32)
    valid = col >= j0[..., None]
    xs = jnp.take_along_axis(x, col, axis=-1).astype(jnp.float32)
    z = jnp.where(valid & (xs >= thr[..., None]), xs * inv_t[..., None], _NEG_INF)
    zx = jnp.where(col == d[..., None], _NEG_INF, z)
    # p and p-without-draft relative to the block's own max (no underflow inside the block).
    zz = jnp.where((kind == 1)[..., None], zx, z)
    mz = jnp.max(zz, axis=-1, keepdims=True)
    w = jnp.exp(zz - jnp.where(mz == _NEG_INF, 0.0, mz))
    if q is not None:
        k = q.shape[1]
        qs = jnp.take_along_axis(q, col[:, :k], axis=-1).astype(jnp.float32)
        p = jnp.exp(z[:, :k] - m[:, :k, None]) / s[:, :k, None]
        r = jnp.maximum(p - qs, 0.0)
        r = jnp.concatenate([r, jnp.zeros_like(w[:, k:])], axis=1)
        w = jnp.where((kind == 2)[..., None], r, w)
    return jnp.take_along_axis(col, _pick(w, u2)[..., None], axis=-1)[..., 0]


def _select(x, q, d, mode, key, inv_t, thr, stats, resid_fn):
    """(cand i32[B, K+1], p_d f32[B, K+1]) from the per-block statistics.

    stats = (a, s_b, sx_b, gi) from a kernel or _ref_block_stats; resid_fn(m, s) -> R_b
    f32[B, K, NB] (second pass over logits and q), used only when q is given.
    """
    a, s_b, sx_b, gi = stats
    k = x.shape[1] - 1
    q = q if k > 0 else None
    # Greedy: the first block holding the maximum, then its lowest argmax column.
    greedy_tok = jnp.take_along_axis(gi, jnp.argmax(a, axis=-1)[..., None], axis=-1)[..., 0]
    # Sampled: block sums rescaled to the row's global max.
    m = jnp.max(a, axis=-1)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    scale = jnp.where(a > _NEG_INF, jnp.exp(a - m_safe[..., None]), 0.0)
    w_p, w_x = s_b * scale, sx_b * scale
    s = jnp.sum(w_p, axis=-1)
    s_safe = jnp.where(s > 0, s, 1.0)
    x_d = jnp.take_along_axis(x, jnp.maximum(d, 0)[..., None], axis=-1)[..., 0].astype(jnp.float32)
    z_d = jnp.where((d >= 0) & (x_d >= thr), x_d * inv_t, _NEG_INF)
    p_d = jnp.exp(z_d - m_safe) / s_safe
    residual = mode == _RESIDUAL
    if q is not None:
        r_b = resid_fn(m_safe[:, :k], s_safe[:, :k])
        r_b = jnp.concatenate([r_b, jnp.zeros_like(w_p[:, k:])], axis=1)
        w_r, r_kind = r_b, 2
    else:
        w_r, r_kind = w_x, 1
    # Residual rows draw from w_r unless it has no mass (then from p, like vLLM).
    use_r = residual & (jnp.sum(w_r, axis=-1) > 0)
    w = jnp.where(use_r[..., None], w_r, w_p)
    kind = jnp.where(use_r, r_kind, 0)
    u1 = su.uniform_from_key(key, jnp.int32(0))
    u2 = su.uniform_from_key(key, jnp.int32(1))
    blk = _pick(w, u1)
    drawn = _draw(x, q, d, kind, blk, m_safe, s_safe, inv_t, thr, u2)
    cand = jnp.where(mode == _GREEDY, greedy_tok, jnp.where(mode >= _BONUS, drawn, -1))
    return cand.astype(jnp.int32), jnp.where(mode >= _BONUS, p_d, 0.0)


# ----------------------------------------------------------------------------------------
# Epilogue: accept decisions
# ----------------------------------------------------------------------------------------


def _accept_uniforms(seeds, positions, k):
    """u_i for the accept test of draft i: f32[B, K]."""
    pos = positions.astype(jnp.int32)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    return su.uniform(su.as_i32_bits(seeds)[:, None], pos, 0, su.SALT_ACCEPT)


def _epilogue(cand, p_d, d, num_draft, draft_probs, temperature, seeds, positions, method,
              synthetic_rates):
    """Accept decisions -> (tokens i32[B, K+1], num_emitted i32[B]).

    cand i32[B, K+1]: per-row emitted token on rejection at that row (or bonus);
    p_d f32[B, K+1]: target prob of the row's draft (sampled rows).
    """
    b, k1 = cand.shape
    k = k1 - 1
    if k == 0:
        return cand[:, :1], jnp.ones((b,), jnp.int32)
    u = _accept_uniforms(seeds, positions, k)
    drafts = d[:, :k]
    if method == "synthetic":
        acc = u < jnp.asarray(synthetic_rates, jnp.float32)[None, :]
    else:
        greedy = (temperature <= 0.0)[:, None]
        if draft_probs is None:
            acc_s = p_d[:, :k] >= u
        else:
            q_d = jnp.take_along_axis(draft_probs, jnp.clip(drafts, 0, draft_probs.shape[-1] - 1)[..., None], -1)[..., 0]
            q_d = q_d.astype(jnp.float32)
            ratio = p_d[:, :k] / jnp.where(q_d > 0, q_d, 1.0)
            acc_s = (q_d > 0) & (ratio >= u)
        acc = jnp.where(greedy, drafts == cand[:, :k], acc_s)
    n = jnp.clip(num_draft.astype(jnp.int32), 0, k)[:, None]
    acc = acc & (jnp.arange(k)[None, :] < n)
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    j = jnp.arange(k1)[None, :]
    final = jnp.take_along_axis(cand, a[:, None], 1)
    tokens = jnp.where(j < a[:, None], d, jnp.where(j == a[:, None], final, -1))
    return tokens.astype(jnp.int32), a + 1


# ----------------------------------------------------------------------------------------
# jnp reference
# ----------------------------------------------------------------------------------------


def _ref_rows(target_logits, draft_probs, d, mode, key, inv_t, thr):
    """Per-row (cand i32[B, K+1], p_d f32[B, K+1]) with blocked jnp reductions."""
    k = target_logits.shape[1] - 1
    stats = _ref_block_stats(target_logits, d, mode, inv_t, thr)

    def resid(m, s):
        return _ref_block_resid(target_logits[:, :k], draft_probs, mode[:, :k], inv_t[:, :k],
                                thr[:, :k], m, s)

    return _select(target_logits, draft_probs, d, mode, key, inv_t, thr, stats, resid)


def ref_rejection_sample(target_logits, draft_tokens, num_draft, draft_probs, temperature,
                         top_k, top_p, seeds, positions, *, method="standard",
                         synthetic_rates=None):
    """Pure-jnp reference of `rejection_sample` (same arguments and outputs)."""
    _validate(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
              top_p, seeds, positions, method, synthetic_rates)
    if synthetic_rates is not None:
        synthetic_rates = jnp.asarray(synthetic_rates, jnp.float32)
    return _ref_jit(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
                    top_p, seeds, positions, synthetic_rates, method=method)


@functools.partial(jax.jit, static_argnames=("method",))
def _ref_jit(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p,
             seeds, positions, synthetic_rates, *, method):
    temperature = jnp.asarray(temperature, jnp.float32)
    d, mode, key, inv_t, thr = _row_params(target_logits, draft_tokens, num_draft,
                                           temperature, top_k, top_p, seeds, positions)
    cand, p_d = _ref_rows(target_logits, draft_probs, d, mode, key, inv_t, thr)
    return _epilogue(cand, p_d, d, num_draft, draft_probs, temperature, seeds, positions,
                     method, synthetic_rates)


# ----------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("method", "kernels", "filtering"))
def _rejection_sample_jit(target_logits, draft_tokens, num_draft, draft_probs, temperature,
                          top_k, top_p, seeds, positions, synthetic_rates, *, method, kernels, filtering):
    temperature = temperature.astype(jnp.float32)
    # No lax.cond for all-greedy batches on the kernels: on GPU a conditional reads its
    # predicate on the host (a sync per call), and greedy rows cost one argmax pass in the kernel.
    d, mode, key, inv_t, thr = _row_params(target_logits, draft_tokens, num_draft, temperature,
                                           top_k, top_p, seeds, positions,
                                           filtering=filtering)
    rest = (d, num_draft, draft_probs, temperature, seeds, positions, method, synthetic_rates)
    if kernels is None:
        def sampled(_):
            return _epilogue(*_ref_rows(target_logits, draft_probs, d, mode, key, inv_t, thr), *rest)

        if not _conditionals_on_device():
            return sampled(None)

        # An all-greedy batch skips the sampling math, ~10% of a greedy K = 7 verification
        # step of the family on the CPU. Greedy rows: the lowest argmax.
        def all_greedy(_):
            cand = su.first_argmax(target_logits)
            return _epilogue(cand, jnp.zeros(cand.shape, jnp.float32), *rest)

        return jax.lax.cond(jnp.all(temperature <= 0.0), all_greedy, sampled, None)
    cand, p_d = _select(target_logits, draft_probs, d, mode, key, inv_t, thr,
                        *kernels.block_stats(target_logits, draft_probs, d, mode, inv_t, thr))
    return _epilogue(cand, p_d, *rest)


def _conditionals_on_device() -> bool:
    """Whether a lax.cond is decided on the device: on the CPU. On a GPU the host reads its
    predicate (a sync per call), so the reference there (tensor parallelism samples
    vocabulary-sharded logits with it) has no conditional: with one, the host waited for
    each tp-2 8B decode step's forward before launching the rest (H200, 2026-11-26)."""
    return jax.default_backend() == "cpu"


def rejection_sample(
    target_logits,  # f32|bf16[B, K+1, V]  rows >= num_draft+1 are padding
    draft_tokens,  # i32[B, K]             padded entries arbitrary (never accepted)
    num_draft,  # i32[B]                   0..K drafts present per request
    draft_probs,  # f32[B, K, V] | None    draft distribution q (None -> one-hot at the draft)
    temperature,  # f32[B]                 0 -> greedy
    top_k,  # i32[B]                       <= 0 -> off
    top_p,  # f32[B]                       >= 1 -> off
    seeds,  # u32|i32[B]                   per-request seed
    positions,  # i32[B]                   position predicted by target_logits[:, 0]
    *,
    method: str = "standard",  # "standard" | "synthetic"
    synthetic_rates=None,  # f32[K] conditional rates (method="synthetic" only)
    kernels: BlockKernels | None = None,  # gpu_kernels() | tpu_kernels(); None: the jnp path (XLA)
    filtering: str = "auto",  # top-k/top-p sort: "auto" (when some row uses them), "off", "on"
):
    """Speculative-decoding verification -> (tokens i32[B, K+1] padded with -1, num_emitted i32[B]).

    num_emitted = accepted drafts + 1. See the module docstring for semantics. The kernels
    and their tuning change speed only, never the tokens (up to float summation order: the
    module docstring). The jnp path has no kernel and, on the CPU, an all-greedy shortcut.
    """
    _validate(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
              top_p, seeds, positions, method, synthetic_rates)
    if filtering not in ("auto", "off", "on"):
        raise ValueError(f"filtering must be 'auto', 'off' or 'on', got {filtering!r}")
    if synthetic_rates is not None:
        synthetic_rates = jnp.asarray(synthetic_rates, jnp.float32)
    if filtering == "auto":
        filtering = su.host_filtering(temperature, top_k, top_p, np.shape(target_logits)[-1])
    return _rejection_sample_jit(
        target_logits, jnp.asarray(draft_tokens), jnp.asarray(num_draft), draft_probs,
        jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(seeds),
        jnp.asarray(positions), synthetic_rates, method=method, kernels=kernels, filtering=filtering)
