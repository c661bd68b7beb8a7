"""Rejection sampling for speculative decoding (standard Leviathan and synthetic).

Public API
----------
rejection_sample(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
                 top_p, seeds, positions, *, method="standard", synthetic_rates=None,
                 impl="auto", block_v=None) -> (tokens i32[B, K+1] padded with -1,
                                                num_emitted i32[B])
ref_rejection_sample(...): same signature minus impl/block_v, pure jnp.
Helpers live in kernels_pallas/sampling_utils.py (uniform, target_probs,
sample_from_probs, filter_thresholds), synthetic-rate conversions in
kernels_pallas/synthetic.py, the impl choice in kernels_pallas/dispatch.py
(impl="auto" -> env JSPEC_KERNEL_IMPL, else gpu / tpu / interpret by backend).

Design
------
The accept decisions of a request are sequential, but every per-row quantity they need
is not. Row i of request b (position positions[b] + i) is reduced over V independently:
  - greedy rows: argmax of the raw logits (ties -> lowest index, like jnp.argmax);
  - sampled rows: z = logit / T over the allowed set (logit >= the row's top-k/top-p
    threshold), online max/sum-exp for p(d_i) = exp(z_d - m) / s, and Gumbel-max races
    argmax(z + g) with g = -log(-log u(seed, pos + i, vocab id, SALT_RACE)):
      * over everything             -> bonus token (row n) / fallback;
      * with the draft excluded     -> recovered token when q is one-hot at the draft;
      * over log(max(p - q, 0)) + g -> recovered token with draft probs (second pass over V,
        because p needs the full normaliser first).
The kernel (one program per row on GPU, per request on TPU, looping or gridding over V
in blocks so V = 151936 never sits in one block) writes per row the candidate token and
p(d_i). A small jnp epilogue then forms accept_i (greedy: d_i == argmax; standard:
u_i <= p/q, q(d) > 0; synthetic: u_i < c_i), the number of leading accepts a, and the
output [d_1..d_a, cand_a, -1...]. Padding rows (i > num_draft) skip all work.

Top-k / top-p need a sort over V. It is done in jnp outside the kernel, only when some
request uses them (lax.cond), and reduced to one raw-logit threshold per row, so the kernel
still reads only logits (no materialised probability buffer). When every request is greedy
a lax.cond takes an argmax-only XLA path (one read of the logits, no RNG).

Random numbers: a stateless int32 hash (sampling_utils) keyed on (seed, position, index,
salt); identical ops inside kernels and the reference, so results do not depend on batch
composition, and kernel == reference token for token (the only float difference is the
summation order of sum-exp, which could flip a decision only at an exact boundary).

GPU lowering: Pallas Triton backend (plt.CompilerParams). Why Triton and not Mosaic GPU:
the kernel is a per-row streaming reduction with int hashing, transcendental ops, masked
selects and argmax-by-min-index over 1-D blocks; the Triton lowering supports exactly this
op mix with no layout work, while Mosaic GPU targets warpgroup/TMA matmul pipelines and its
reduction/int-op coverage is narrower. Triton is deprecated in jax 0.11 but still runs on
the H200 (jax 0.11.2); the same kernel body runs under interpret=True in CI, so only the
lowering itself is untested off-GPU. To avoid masked out-of-bounds loads the last V block
is shifted to end at V and its columns already seen are masked out.
TPU lowering: Mosaic TPU, one request per program, grid (B, passes, V blocks) with VMEM
scratch accumulators; blocks are (K+1, bV) (full second-minor dim, bV a multiple of 128),
the ragged last V block is masked by column index. Tested under pltpu.InterpretParams().
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import sampling_utils as su
from kernels_pallas.dispatch import resolve_impl

# Row modes (what row i of a request needs).
_PAD, _GREEDY, _BONUS, _RESIDUAL = 0, 1, 2, 3
_BIG = np.int32(2**31 - 1)
_NEG_INF = np.float32(-np.inf)
_N_IPARAMS = 4  # d, mode, key, unused
_N_FPARAMS = 2  # inv_t, thr


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
# Shared prologue / epilogue (plain jnp on [B, K+1] sized arrays)
# ----------------------------------------------------------------------------------------


def _row_params(target_logits, draft_tokens, num_draft, temperature, top_k, top_p, seeds,
                positions):
    """Per-row kernel parameters.

    Returns d i32[B, K+1] (draft at row i, -1 where absent), mode i32[B, K+1],
    key i32[B, K+1] (race RNG stream), inv_t f32[B, K+1], thr f32[B, K+1].
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
    thr = su.filter_thresholds(target_logits, temperature, top_k, top_p)
    return d, mode.astype(jnp.int32), key, inv_t, thr


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
    """Per-row (cand i32[B, K+1], p_d f32[B, K+1]) with full-V jnp ops."""
    x = target_logits.astype(jnp.float32)
    k = x.shape[1] - 1
    col = lax.broadcasted_iota(jnp.int32, x.shape, 2)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    allowed = x >= thr[..., None]
    z = jnp.where(allowed, x * inv_t[..., None], _NEG_INF)
    m = jnp.max(z, axis=-1, keepdims=True)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    s = jnp.sum(jnp.exp(z - m_safe), axis=-1, keepdims=True)
    is_d = col == d[..., None]
    z_d = jnp.max(jnp.where(is_d, z, _NEG_INF), axis=-1)
    p_d = jnp.exp(z_d - m_safe[..., 0]) / s[..., 0]
    score = z + su.gumbel_from_key(key[..., None], col)
    race_all = jnp.argmax(score, axis=-1).astype(jnp.int32)
    score_x = jnp.where(is_d, _NEG_INF, score)
    race_x = jnp.where(jnp.max(score_x, -1) > _NEG_INF, jnp.argmax(score_x, -1), race_all).astype(jnp.int32)
    recovered = race_x
    if draft_probs is not None and k > 0:
        p = jnp.exp(z[:, :k] - m_safe[:, :k]) / s[:, :k]
        r = p - draft_probs.astype(jnp.float32)
        g = su.gumbel_from_key(key[:, :k, None], col[:, :k])
        score_r = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + g, _NEG_INF)
        rr = jnp.where(jnp.max(score_r, -1) > _NEG_INF, jnp.argmax(score_r, -1), race_all[:, :k])
        recovered = jnp.concatenate([rr.astype(jnp.int32), race_all[:, k:]], axis=1)
    cand = jnp.where(mode == _GREEDY, greedy_tok,
                     jnp.where(mode == _RESIDUAL, recovered,
                               jnp.where(mode == _BONUS, race_all, -1)))
    return cand.astype(jnp.int32), jnp.where(mode >= _BONUS, p_d, 0.0)


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
# Kernel math shared by the GPU and TPU bodies: blocks x f32[..., bV] with per-row params
# broadcasting against them (scalars on GPU, [K+1, 1] columns on TPU).
# ----------------------------------------------------------------------------------------


def _block_argmax(score, col):
    mx = jnp.max(score, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(score == mx, col, _BIG), axis=-1, keepdims=True)
    return mx, idx


def _merge(mx, idx, bmx, bidx):
    # Strict '>' keeps the earlier block on ties: lowest index wins, like jnp.argmax.
    take = bmx > mx
    return jnp.where(take, bmx, mx), jnp.where(take, bidx, idx)


def _init_state(shape):
    """(g_max, g_idx, m, s, z_d, ra_max, ra_idx, rx_max, rx_idx)."""
    ninf = jnp.full(shape, _NEG_INF, jnp.float32)
    zero_i = jnp.zeros(shape, jnp.int32)
    return (ninf, zero_i, ninf, jnp.zeros(shape, jnp.float32), ninf, ninf, zero_i, ninf, zero_i)


def _greedy_update(state, x, col, valid):
    g_max, g_idx = _merge(state[0], state[1], *_block_argmax(jnp.where(valid, x, _NEG_INF), col))
    return (g_max, g_idx) + tuple(state[2:])


def _pass0_update(state, x, col, valid, d, key, inv_t, thr):
    g_max, g_idx, m, s, z_d, ra_max, ra_idx, rx_max, rx_idx = state
    g_max, g_idx = _merge(g_max, g_idx, *_block_argmax(jnp.where(valid, x, _NEG_INF), col))
    z = jnp.where(valid & (x >= thr), x * inv_t, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    s = s * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(z - m_safe), axis=-1, keepdims=True)
    is_d = col == d
    z_d = jnp.maximum(z_d, jnp.max(jnp.where(is_d, z, _NEG_INF), axis=-1, keepdims=True))
    score = z + su.gumbel_from_key(key, col)
    ra_max, ra_idx = _merge(ra_max, ra_idx, *_block_argmax(score, col))
    rx_max, rx_idx = _merge(rx_max, rx_idx, *_block_argmax(jnp.where(is_d, _NEG_INF, score), col))
    return (g_max, g_idx, m_new, s, z_d, ra_max, ra_idx, rx_max, rx_idx)


def _pass1_update(rr, x, q, col, valid, key, inv_t, thr, m, s):
    """Race over log(max(p - q, 0)) + g for one block; rr = (max, idx)."""
    z = jnp.where(valid & (x >= thr), x * inv_t, _NEG_INF)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    r = jnp.exp(z - m_safe) / s - q
    pos = valid & (r > 0)
    score = jnp.where(pos, jnp.log(jnp.where(pos, r, 1.0)) + su.gumbel_from_key(key, col), _NEG_INF)
    return _merge(rr[0], rr[1], *_block_argmax(score, col))


def _finalize(state, mode):
    """(cand, p_d) from a pass-0 state, using the no-q recovered token for residual rows."""
    g_max, g_idx, m, s, z_d, ra_max, ra_idx, rx_max, rx_idx = state
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    p_d = jnp.exp(z_d - m_safe) / s
    recovered = jnp.where(rx_max > _NEG_INF, rx_idx, ra_idx)
    cand = jnp.where(mode == _GREEDY, g_idx,
                     jnp.where(mode == _RESIDUAL, recovered, jnp.where(mode == _BONUS, ra_idx, -1)))
    return cand.astype(jnp.int32), jnp.where(mode >= _BONUS, p_d, 0.0)


# ----------------------------------------------------------------------------------------
# GPU kernel (Triton backend; also the interpret=True body): one program per row.
# ----------------------------------------------------------------------------------------


def _gpu_kernel(ip_ref, fp_ref, x_ref, *rest, v, bv, has_q, n_poison=0):
    # ip_ref i32[4] (d, mode, key, -), fp_ref f32[2] (inv_t, thr), x_ref [V] logits row,
    # q_ref [V] draft probs row (if has_q), [poisoned aliases, unread], cand_ref i32[1],
    # pd_ref f32[1].
    q_ref = rest[0] if has_q else None
    cand_ref, pd_ref = rest[has_q + n_poison:]
    d, mode, key = ip_ref[0], ip_ref[1], ip_ref[2]
    inv_t, thr = fp_ref[0], fp_ref[1]
    nb = pl.cdiv(v, bv)

    def block(j, ref):
        # The last block is shifted to end at V (no out-of-bounds loads); its columns
        # already covered by the previous block are masked out.
        start = jnp.minimum(j * bv, v - bv)
        col = start + lax.broadcasted_iota(jnp.int32, (bv,), 0)
        return ref[pl.ds(start, bv)].astype(jnp.float32), col, col >= j * bv

    @pl.when(mode == _PAD)
    def _():
        cand_ref[...] = jnp.full((1,), -1, jnp.int32)
        pd_ref[...] = jnp.zeros((1,), jnp.float32)

    @pl.when(mode == _GREEDY)
    def _():
        def body(j, st):
            x, col, valid = block(j, x_ref)
            return _greedy_update(st, x, col, valid)
        st = lax.fori_loop(0, nb, body, _init_state((1,)))
        cand_ref[...] = st[1]
        pd_ref[...] = jnp.zeros((1,), jnp.float32)

    @pl.when(mode >= _BONUS)
    def _():
        def body0(j, st):
            x, col, valid = block(j, x_ref)
            return _pass0_update(st, x, col, valid, d, key, inv_t, thr)
        st = lax.fori_loop(0, nb, body0, _init_state((1,)))
        cand, p_d = _finalize(st, mode)
        cand_ref[...] = cand
        pd_ref[...] = p_d
        if has_q:
            m, s, ra_idx = st[2], st[3], st[6]

            @pl.when(mode == _RESIDUAL)
            def _():
                def body1(j, rr):
                    x, col, valid = block(j, x_ref)
                    q = q_ref[pl.ds(jnp.minimum(j * bv, v - bv), bv)].astype(jnp.float32)
                    return _pass1_update(rr, x, q, col, valid, key, inv_t, thr, m, s)
                rr = lax.fori_loop(0, nb, body1, (jnp.full((1,), _NEG_INF), jnp.zeros((1,), jnp.int32)))
                cand_ref[...] = jnp.where(rr[0] > _NEG_INF, rr[1], ra_idx)


def _gpu_block_v(v, block_v):
    """Largest power of two <= min(block_v, V) (Triton blocks must be powers of two)."""
    bv = min(block_v or 2048, v)
    return 1 << (bv.bit_length() - 1)


def _poison_inputs(shape):
    """Sentinel-filled output buffers (aliased to the outputs) so tests see unwritten slots."""
    return [jnp.full(shape, -7, jnp.int32), jnp.full(shape, jnp.nan, jnp.float32)]


def _rows_gpu(target_logits, draft_probs, ip, fp, *, interpret, block_v, num_warps,
              poison=False):
    b, k1, v = target_logits.shape
    k = k1 - 1
    bv = _gpu_block_v(v, block_v)
    has_q = draft_probs is not None and k > 0
    in_specs = [
        pl.BlockSpec((None, None, _N_IPARAMS), lambda bi, i: (bi, i, 0)),
        pl.BlockSpec((None, None, _N_FPARAMS), lambda bi, i: (bi, i, 0)),
        pl.BlockSpec((None, None, v), lambda bi, i: (bi, i, 0)),
    ]
    args = [ip, fp, target_logits]
    if has_q:
        # The bonus row (i == K) has no q row; it never reads it (mode != RESIDUAL).
        in_specs.append(pl.BlockSpec((None, None, v), lambda bi, i: (bi, jnp.minimum(i, k - 1), 0)))
        args.append(draft_probs)
    out_spec = pl.BlockSpec((None, None, 1), lambda bi, i: (bi, i, 0))
    kwargs = {}
    if poison:
        in_specs += [out_spec, out_spec]
        args += _poison_inputs((b, k1, 1))
        kwargs["input_output_aliases"] = {len(args) - 2: 0, len(args) - 1: 1}
    if not interpret:
        from jax.experimental.pallas import triton as plt
        kwargs["compiler_params"] = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    cand, p_d = pl.pallas_call(
        functools.partial(_gpu_kernel, v=v, bv=bv, has_q=has_q, n_poison=2 * poison),
        grid=(b, k1),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, k1, 1), jnp.int32),
                   jax.ShapeDtypeStruct((b, k1, 1), jnp.float32)],
        interpret=interpret,
        name="rejection_rows_gpu",
        **kwargs,
    )(*args)
    return cand[..., 0], p_d[..., 0]


# ----------------------------------------------------------------------------------------
# TPU kernel (Mosaic TPU): one request per program, grid (B, passes, V blocks).
# ----------------------------------------------------------------------------------------


def _tpu_kernel(ip_ref, fp_ref, x_ref, *rest, v, bv, k, has_q, n_poison=0):
    # ip_ref i32[K+1, 4], fp_ref f32[K+1, 2], x_ref [K+1, bV], q_ref [K, bV] (if has_q),
    # [poisoned aliases, unread], outputs cand_ref i32[K+1, 1], pd_ref f32[K+1, 1], then
    # VMEM scratch accumulators.
    q_ref = rest[0] if has_q else None
    cand_ref, pd_ref, *scratch = rest[has_q + n_poison:]
    st_refs, rr_refs = scratch[:9], scratch[9:]
    p, j = pl.program_id(1), pl.program_id(2)
    last_p, last_j = pl.num_programs(1) - 1, pl.num_programs(2) - 1
    d, mode, key = ip_ref[:, 0:1], ip_ref[:, 1:2], ip_ref[:, 2:3]
    inv_t, thr = fp_ref[:, 0:1], fp_ref[:, 1:2]
    col = j * bv + lax.broadcasted_iota(jnp.int32, (k + 1, bv), 1)
    valid = col < v  # the ragged last block holds garbage past V

    @pl.when((p == 0) & (j == 0))
    def _():
        for ref, val in zip(st_refs, _init_state((k + 1, 1))):
            ref[...] = val
        if has_q:
            rr_refs[0][...] = jnp.full((k, 1), _NEG_INF, jnp.float32)
            rr_refs[1][...] = jnp.zeros((k, 1), jnp.int32)

    @pl.when(p == 0)
    def _():
        st = tuple(ref[...] for ref in st_refs)
        x = x_ref[...].astype(jnp.float32)
        for ref, val in zip(st_refs, _pass0_update(st, x, col, valid, d, key, inv_t, thr)):
            ref[...] = val

    if has_q:
        @pl.when(p == 1)
        def _():
            x = x_ref[0:k, :].astype(jnp.float32)
            q = q_ref[...].astype(jnp.float32)
            rr = (rr_refs[0][...], rr_refs[1][...])
            m, s = st_refs[2][0:k, :], st_refs[3][0:k, :]
            rr = _pass1_update(rr, x, q, col[0:k], valid[0:k], key[0:k], inv_t[0:k], thr[0:k], m, s)
            rr_refs[0][...] = rr[0]
            rr_refs[1][...] = rr[1]

    @pl.when((p == last_p) & (j == last_j))
    def _():
        st = tuple(ref[...] for ref in st_refs)
        cand, p_d = _finalize(st, mode)
        cand_ref[...] = cand
        pd_ref[...] = p_d
        if has_q:
            rr_ok = rr_refs[0][...] > _NEG_INF
            rec = jnp.where(rr_ok, rr_refs[1][...], st[6][0:k])
            cand_ref[0:k, :] = jnp.where(mode[0:k] == _RESIDUAL, rec, cand[0:k])


def _tpu_block_v(v, block_v):
    bv = block_v or 4096
    if v <= bv:
        return v  # one full-width block (any V is a legal full dim)
    return max(128, (bv // 128) * 128)


def _rows_tpu(target_logits, draft_probs, ip, fp, *, interpret, block_v, poison=False):
    from jax.experimental.pallas import tpu as pltpu

    b, k1, v = target_logits.shape
    k = k1 - 1
    bv = _tpu_block_v(v, block_v)
    nv = pl.cdiv(v, bv)
    has_q = draft_probs is not None and k > 0
    n_pass = 2 if has_q else 1
    in_specs = [
        pl.BlockSpec((None, k1, _N_IPARAMS), lambda bi, p, j: (bi, 0, 0)),
        pl.BlockSpec((None, k1, _N_FPARAMS), lambda bi, p, j: (bi, 0, 0)),
        pl.BlockSpec((None, k1, bv), lambda bi, p, j: (bi, 0, j)),
    ]
    args = [ip, fp, target_logits]
    if has_q:
        # Pass 0 parks q on block 0 (fetched once); pass 1 streams it.
        in_specs.append(pl.BlockSpec((None, k, bv), lambda bi, p, j: (bi, 0, j * p)))
        args.append(draft_probs)
    out_spec = pl.BlockSpec((None, k1, 1), lambda bi, p, j: (bi, 0, 0))
    aliases = {}
    if poison:
        in_specs += [out_spec, out_spec]
        args += _poison_inputs((b, k1, 1))
        aliases = {len(args) - 2: 0, len(args) - 1: 1}
    f32, i32 = jnp.float32, jnp.int32
    scratch = [pltpu.VMEM((k1, 1), t) for t in (f32, i32, f32, f32, f32, f32, i32, f32, i32)]
    if has_q:
        scratch += [pltpu.VMEM((k, 1), f32), pltpu.VMEM((k, 1), i32)]
    cand, p_d = pl.pallas_call(
        functools.partial(_tpu_kernel, v=v, bv=bv, k=k, has_q=has_q, n_poison=2 * poison),
        grid=(b, n_pass, nv),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, k1, 1), jnp.int32),
                   jax.ShapeDtypeStruct((b, k1, 1), jnp.float32)],
        scratch_shapes=scratch,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="rejection_rows_tpu",
    )(*args)
    return cand[..., 0], p_d[..., 0]


# ----------------------------------------------------------------------------------------
# Public wrapper
# ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("method", "impl", "block_v", "num_warps"))
def _rejection_sample_jit(target_logits, draft_tokens, num_draft, draft_probs, temperature,
                          top_k, top_p, seeds, positions, synthetic_rates, *, method, impl,
                          block_v, num_warps):
    temperature = temperature.astype(jnp.float32)
    b, k1, _ = target_logits.shape
    d_greedy = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], 1)

    def greedy_rows(_):
        # Every request greedy: one argmax over the logits, no RNG, no filter sort.
        cand = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        return cand, jnp.zeros((b, k1), jnp.float32), d_greedy

    def kernel_rows(_):
        d, mode, key, inv_t, thr = _row_params(target_logits, draft_tokens, num_draft,
                                               temperature, top_k, top_p, seeds, positions)
        if impl == "reference":
            cand, p_d = _ref_rows(target_logits, draft_probs, d, mode, key, inv_t, thr)
        else:
            ip = jnp.stack([d, mode, key, jnp.zeros_like(d)], axis=-1)
            fp = jnp.stack([inv_t, thr], axis=-1)
            if impl in ("tpu", "tpu_interpret"):
                cand, p_d = _rows_tpu(target_logits, draft_probs, ip, fp,
                                      interpret=impl == "tpu_interpret", block_v=block_v)
            else:
                cand, p_d = _rows_gpu(target_logits, draft_probs, ip, fp,
                                      interpret=impl == "interpret", block_v=block_v,
                                      num_warps=num_warps)
        return cand, p_d, d_greedy

    cand, p_d, d = lax.cond(jnp.all(temperature <= 0.0), greedy_rows, kernel_rows, None)
    return _epilogue(cand, p_d, d, num_draft, draft_probs, temperature, seeds, positions,
                     method, synthetic_rates)


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
    impl: str = "auto",  # see kernels_pallas.dispatch.resolve_impl
    block_v: int | None = None,  # V block size (GPU: power of two, TPU: multiple of 128)
    num_warps: int = 8,  # Triton warps per program (GPU only)
):
    """Speculative-decoding verification -> (tokens i32[B, K+1] padded with -1, num_emitted i32[B]).

    num_emitted = accepted drafts + 1. See the module docstring for semantics.
    """
    _validate(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k,
              top_p, seeds, positions, method, synthetic_rates)
    if synthetic_rates is not None:
        synthetic_rates = jnp.asarray(synthetic_rates, jnp.float32)
    return _rejection_sample_jit(
        target_logits, jnp.asarray(draft_tokens), jnp.asarray(num_draft), draft_probs,
        jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(seeds),
        jnp.asarray(positions), synthetic_rates, method=method, impl=resolve_impl(impl),
        block_v=block_v, num_warps=num_warps)
