"""The speculative pieces of a flat step (jspec/engine/flat_runner.py), as plain functions.

Device data flow of a speculative flat step, K drafts (Q = K + 1; a decode step of width
Q < K + 1 verifies Q - 1 of them; Q = 1 verifies none, and its drafter only writes its
cache for the step's pairs, proposing nothing):
  tokens [T] --target (aux layers)--> hidden [1, T, H], aux [1, T, n, H]
  hidden at logits_idx [N, Q] --lm_head--> logits f32[N, Q, V]
  drafts = tokens at logits_idx[:, 1:] (a decode row's d_1..d_K; num_draft says how many)
  rejection_sample(logits, drafts, num_draft, q) --> out [N, Q] (-1 padded), n_emit [N]
    (a prefill row verifies nothing: it samples its one token at its last chunk token)
  pairs [T] (``pairs``): a decode row's emitted tokens at its positions, a prefill row's
    next prompt tokens and its sampled one; the bonus pair of row i at
    logits_idx[i, n_emit - 1]
  Drafter.propose(pairs, aux, the target's metadata) --> next drafts [N, K] (+ q [N, K, V])
  --> one packed i32[N, (K + 1) + 1 + K]: tokens | count | next drafts
Async scheduling: a verification step chained behind one still on the device continues it
(``continue_flat``): the rows as they stood before that step, moved on by what it emitted.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jspec.drafters.propose import slots_for
from jspec.engine.flat_input import FlatInput
from jspec.engine.logits_processing import extend_history
from jspec.engine.logprobs import info_width
from jspec.parallel.multihost import host_copy


@dataclasses.dataclass
class StepResult:
    """A step's output on the host, per scheduled row (n rows)."""

    tokens: np.ndarray  # i32[n, W]     emitted tokens, -1 padded (W: K + 1, or a fed-back call's steps)
    num_emitted: np.ndarray  # i32[n]   of a decode row (a prefill row emits tokens[:, 0] if it samples)
    drafts: np.ndarray  # i32[n, K]     next proposals (K = 0 without a drafter)
    logprobs: np.ndarray | None = None  # i32[n, W, F] blocks of the emitted tokens (with processors)
    prompt_logprobs: np.ndarray | None = None  # i32[n, P, F] of each position's next prompt token


def continue_flat(inp: FlatInput, prev, K: int, page_size: int, num_pages: int) -> FlatInput:
    """The verification input of a decode step (rows [N, Q], Q <= K + 1) whose rows with
    host tokens -1 continue ``prev`` (i32[N, (K+1) + 1 + K], the step before's packed
    output, still on the device). Such a row holds its state before ``prev`` (positions from
    its num_computed then, ``num_draft`` drafts): ``prev`` emitted n tokens, so the row moves
    n positions on and verifies [bonus, prev's first num_draft drafts]; its positions past
    them stay padding. Rows with host tokens are left as they are (an unchained step takes
    this call with ``prev`` zeros)."""
    m = inp.meta
    N, Q = inp.logits_idx.shape
    host = inp.tokens.reshape(N, Q)
    chained = (jnp.arange(N) < m.num_seqs[0]) & (host[:, 0] < 0)
    n_prev = jnp.where(chained, prev[:, K + 1], 0)  # i32[N]
    bonus = jnp.take_along_axis(prev[:, : K + 1], jnp.maximum(n_prev - 1, 0)[:, None], axis=1)  # [N, 1]
    tokens = jnp.where(chained[:, None], jnp.concatenate([bonus, prev[:, K + 2 : K + 1 + Q]], axis=1), host)
    positions = m.positions.reshape(N, Q) + n_prev[:, None]
    valid = jnp.arange(Q)[None] <= inp.num_draft[:, None]
    slots = jnp.where(chained[:, None], slots_for(m.page_table, positions, valid, page_size, num_pages),
                      m.slot_mapping.reshape(N, Q))
    meta = m.replace(positions=positions.reshape(1, -1), slot_mapping=slots.reshape(1, -1),
                     kv_lens=m.kv_lens + n_prev)
    proc = inp.proc
    if proc is not None:  # the history as the host knew it lacks what prev emitted
        hist, n_hist = extend_history(proc.hist, proc.n_hist, prev[:, : K + 1], n_prev)
        proc = proc.replace(hist=hist, n_hist=n_hist)
    return inp.replace(tokens=tokens.reshape(-1), meta=meta, sample_pos=inp.sample_pos + n_prev, proc=proc)


def pairs(inp: FlatInput, out):
    """i32[1, T] the drafter's pair tokens (module docstring) from the step's output out [N, Q]."""
    src = inp.pair_src
    return jnp.where(src >= 0, jnp.maximum(out, 0).reshape(-1)[jnp.maximum(src, 0)], inp.pair_next)[None]


def bonus_index(inp: FlatInput, n_emit):
    """i32[N] the flat index of each row's bonus pair (its last emitted token's)."""
    return jnp.take_along_axis(inp.logits_idx, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]


def read_packed(out, n: int, K: int, n_top: int) -> StepResult:
    """Wait for a speculative step's output (packed i32[N, ...], or with processors
    (packed, prompt logprob blocks i32[T, F], segment offsets i32[N + 1])) and split its
    first n rows."""
    plp_flat = cu = None
    if isinstance(out, tuple):
        out, plp_flat, cu = out
    packed = host_copy(out)[:n]
    K1 = K + 1
    res = StepResult(packed[:, :K1], packed[:, K1], packed[:, K1 + 1 : 2 * K1])
    if packed.shape[1] > 2 * K1:  # with processors: the emitted tokens' logprob blocks
        res.logprobs = packed[:, 2 * K1 : 2 * K1 + K1 * info_width(n_top)].reshape(n, K1, -1)
        res.prompt_logprobs = per_row(plp_flat, cu, n)
    return res


def per_row(flat, cu, n: int) -> np.ndarray:
    """Prompt logprob blocks i32[T, F] of a flat step -> i32[n, P, F] by segment (P: the
    longest; 0 when no row asked for them)."""
    flat, cu = host_copy(flat), host_copy(cu)
    width = int(max(cu[1 : n + 1] - cu[:n], default=0)) if flat.shape[0] else 0
    out = np.zeros((n, width, flat.shape[-1]), np.int32)
    for i in range(n if width else 0):
        out[i, : cu[i + 1] - cu[i]] = flat[cu[i] : cu[i + 1]]
    return out


def empty_prev(N: int, K: int, mesh):
    """A stand-in ``prev`` for compiling a chained verification step."""
    from jspec.parallel import replicate

    return replicate(jnp.zeros((N, 2 * K + 2), jnp.int32), mesh)


def pack(out, n_emit, drafts, K: int, lp=None):
    """One int32 block [N, (K+1) + 1 + K (+ (K+1) F)]: a single device->host read per step.
    ``out`` i32[N, Q] and ``lp`` i32[N, Q, F] of a step of width Q <= K + 1 are padded to
    K + 1 (-1, zeros), so every width's output has one layout and any call can chain
    behind any other."""
    pad = K + 1 - out.shape[1]
    parts = [jnp.pad(out, ((0, 0), (0, pad)), constant_values=-1), n_emit[:, None], drafts[:, :K].astype(jnp.int32)]
    if lp is not None:  # logprob blocks of the emitted tokens ride along
        parts.append(jnp.pad(lp, ((0, 0), (0, pad), (0, 0))).reshape(lp.shape[0], -1))
    return jnp.concatenate(parts, axis=1)
