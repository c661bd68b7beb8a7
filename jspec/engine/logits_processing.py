"""Logits processors inside the jitted step: vLLM's SamplingParams semantics on the target's
logits [B, Q, V] before rejection sampling, plain decoding (Q = 1) and verification alike.

Order (vLLM's sampler): allowed_token_ids, bad_words, min_tokens (EOS and stop_token_ids
banned while the output is shorter), logit_bias, then the repetition, frequency and
presence penalties; min_p last, on sampled rows only (it keeps x >= max x + T log min_p,
i.e. p >= min_p * max p after temperature, so it is a threshold on these logits).
Temperature, top-k and top-p stay in the rejection sampler, which sees the processed logits.

Verification: position j of a row's window [last, d_1..d_K] predicts the token after d_j,
so it sees the history PLUS d_1..d_j (accepted if the rejection reaches j): penalty counts,
min_tokens' output length and bad-word prefixes all include them, and greedy speculative
output equals greedy plain output with any processor.

Per-row device state (``ProcInput``) keeps the compiled shapes bucketed: the row's token
history ``hist`` is as wide as its page table (W * page_size, already a bucket), token
lists are one sparse table of (id, kind, value) entries padded to a power of two, and
multi-token bad words one [NW, LW] table. Rows without processors carry neutral values
(bias 0, penalties 0 / 1, min_p 0) that leave their logits bit for bit unchanged, so a
batch needs the processors only when one of its rows does: ``StepInput.proc`` is None
otherwise and the step compiles exactly as without this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Kinds of the sparse entries.
BIAS, ALLOW, BAN, STOP = 0, 1, 2, 3
_NEG_INF = np.float32(-np.inf)


@struct.dataclass
class ProcInput:
    hist: jax.Array  # i32[B, T]      the row's prompt + output tokens (-1 past n_hist)
    n_prompt: jax.Array  # i32[B]
    n_hist: jax.Array  # i32[B]       tokens in hist
    min_tokens: jax.Array  # i32[B]
    repetition: jax.Array  # f32[B]   1: off
    frequency: jax.Array  # f32[B]    0: off
    presence: jax.Array  # f32[B]     0: off
    min_p: jax.Array  # f32[B]        0: off
    has_allowed: jax.Array  # bool[B] the row has an allowed_token_ids whitelist
    ent_ids: jax.Array  # i32[B, E]   token ids (-1: padding)
    ent_kind: jax.Array  # i32[B, E]  BIAS | ALLOW | BAN | STOP (banned while output < min_tokens)
    ent_val: jax.Array  # f32[B, E]   the bias of BIAS entries
    bw_ids: jax.Array  # i32[B, NW, LW] multi-token bad words, right-aligned (-1: padding)
    # Prompt logprobs (prefill steps where a row asks for them, else P = 0): the prompt token
    # after each query position, whose logprob that position's logits give (-1: none).
    prompt_next: jax.Array  # i32[B, P]  P = Q or 0


def extend_history(hist, n_hist, tokens, count):
    """Append tokens[b, :count[b]] to row b's history: (hist i32[B, T], n_hist i32[B])."""
    B, T = hist.shape
    n = tokens.shape[1]
    i = jnp.arange(n, dtype=jnp.int32)[None, :]
    idx = jnp.where(i < count[:, None], n_hist[:, None] + i, T)  # T: dropped
    hist = hist.at[jnp.arange(B)[:, None], idx].set(tokens.astype(jnp.int32), mode="drop")
    return hist, n_hist + count


def _table(ids, keep, V, dtype=bool, val=None):
    """Sparse entries -> dense f32|bool[B, V] (True, or the sum of ``val``, where kept)."""
    B = ids.shape[0]
    col = jnp.where(keep & (ids >= 0), ids, V)  # V: dropped
    rows = jnp.arange(B)[:, None]
    if val is None:
        return jnp.zeros((B, V), dtype).at[rows, col].set(True, mode="drop")
    return jnp.zeros((B, V), jnp.float32).at[rows, col].add(val, mode="drop")


def _counts(p: ProcInput, drafts, Q: int, V: int):
    """(output counts f32[B, Q, V] at each position, drafts before it included;
    prompt presence bool[B, V])."""
    B, T = p.hist.shape
    t = jnp.arange(T)[None, :]
    rows = jnp.arange(B)[:, None]
    tok = jnp.where(p.hist >= 0, p.hist, V)
    in_out = (t >= p.n_prompt[:, None]) & (t < p.n_hist[:, None])
    in_prompt = t < jnp.minimum(p.n_prompt, p.n_hist)[:, None]
    out = jnp.zeros((B, V), jnp.float32).at[rows, jnp.where(in_out, tok, V)].add(1.0, mode="drop")
    seen = jnp.zeros((B, V), bool).at[rows, jnp.where(in_prompt, tok, V)].set(True, mode="drop")
    counts = jnp.broadcast_to(out[:, None], (B, Q, V))
    if Q > 1:  # draft i (d_{i+1}) counts at positions j > i
        before = jnp.arange(Q - 1)[None, :] < jnp.arange(Q)[:, None]  # [Q, Q-1]
        dtok = jnp.where(before[None] & (drafts[:, None, :] >= 0), drafts[:, None, :], V)  # [B, Q, Q-1]
        bj = jnp.broadcast_to(jnp.arange(Q)[None, :, None], dtok.shape)
        bb = jnp.broadcast_to(jnp.arange(B)[:, None, None], dtok.shape)
        counts = counts.at[bb, bj, dtok].add(1.0, mode="drop")
    return counts, seen


def _bad_word_bans(ext, p: ProcInput, Q: int, V: int):
    """bool[B, Q, V]: the last token of each multi-token bad word whose other tokens are the
    output's last tokens before position j (vLLM matches within the output only)."""
    B, NW, LW = p.bw_ids.shape
    T = ext.shape[1]
    n = jnp.arange(Q)[None, :]
    L = p.n_hist[:, None] + n  # [B, Q] tokens before position j
    pos = L[:, :, None] - (LW - 1) + jnp.arange(LW - 1)[None, None, :]  # [B, Q, LW-1]
    ctx = jnp.take_along_axis(ext, jnp.clip(pos, 0, T - 1).reshape(B, -1), axis=1).reshape(pos.shape)
    ctx = jnp.where(pos >= p.n_prompt[:, None, None], ctx, -2)  # the prompt never matches
    pre = p.bw_ids[:, None, :, : LW - 1]  # [B, 1, NW, LW-1]
    match = jnp.all((pre < 0) | (pre == ctx[:, :, None, :]), axis=-1)  # [B, Q, NW]
    last = p.bw_ids[:, :, LW - 1]  # [B, NW]
    col = jnp.where(match & (last[:, None, :] >= 0), last[:, None, :], V)
    bb = jnp.broadcast_to(jnp.arange(B)[:, None, None], col.shape)
    bj = jnp.broadcast_to(n[:, :, None], col.shape)
    return jnp.zeros((B, Q, V), bool).at[bb, bj, col].set(True, mode="drop")


def apply_processors(logits, p: ProcInput, drafts, temperature):
    """Processed logits f32[B, Q, V].

    logits f32|bf16[B, Q, V]: position j predicts the token after history + d_1..d_j;
    drafts i32[B, Q-1] (d_1..d_{Q-1}; -1 or anything where absent: those positions are
    never emitted); temperature f32[B] (min_p acts on sampled rows only).
    """
    B, Q, V = logits.shape
    x = logits.astype(jnp.float32)
    drafts = drafts.astype(jnp.int32)
    ext, _ = extend_history(p.hist, p.n_hist, drafts, jnp.full((B,), Q - 1, jnp.int32))
    kind = p.ent_kind
    allowed = _table(p.ent_ids, kind == ALLOW, V)
    x = jnp.where(p.has_allowed[:, None, None] & ~allowed[:, None, :], _NEG_INF, x)
    x = jnp.where(_table(p.ent_ids, kind == BAN, V)[:, None, :], _NEG_INF, x)
    x = jnp.where(_bad_word_bans(ext, p, Q, V), _NEG_INF, x)
    n_out = (p.n_hist - p.n_prompt)[:, None] + jnp.arange(Q)[None, :]  # [B, Q] output length before j
    early = (n_out < p.min_tokens[:, None])[..., None]
    x = jnp.where(early & _table(p.ent_ids, kind == STOP, V)[:, None, :], _NEG_INF, x)
    x = x + _table(p.ent_ids, kind == BIAS, V, val=p.ent_val)[:, None, :]
    counts, prompt_seen = _counts(p, drafts, Q, V)
    rep = p.repetition[:, None, None]
    seen = prompt_seen[:, None, :] | (counts > 0)
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - p.frequency[:, None, None] * counts - p.presence[:, None, None] * (counts > 0)
    on = (temperature > 0) & (p.min_p > 0)
    shift = jnp.where(on, temperature * jnp.log(jnp.where(on, p.min_p, 1.0)), _NEG_INF)
    thr = jnp.max(x, axis=-1, keepdims=True) + shift[:, None, None]
    return jnp.where(x >= thr, x, _NEG_INF)


# ----------------------------------------------------------------------------------------
# Host side: Sequences -> ProcInput (numpy)
# ----------------------------------------------------------------------------------------


def _pow2(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def wants_processing(seq) -> bool:
    """Does this request need ProcInput (processors, or logprobs to return)?"""
    p = seq.params
    return p.uses_processors or p.logprobs is not None or p.prompt_logprobs is not None


def _entries(seq, eos_ids) -> list[tuple[int, int, float]]:
    p = seq.params
    e = [(t, ALLOW, 0.0) for t in p.allowed_token_ids or ()]
    e += [(t, BIAS, v) for t, v in (p.logit_bias or {}).items()]
    e += [(w[0], BAN, 0.0) for w in seq.bad_words_ids if len(w) == 1]
    if p.min_tokens:  # vLLM bans EOS even with ignore_eos while the output is short
        e += [(t, STOP, 0.0) for t in sorted(set(p.stop_token_ids or ()) | set(eos_ids))]
    return e


def build_proc_input(rows: list, B: int, T: int, Q: int, eos_ids, prefill: bool) -> ProcInput:
    """The processors' input of a batch of B rows (``rows``: the ScheduledSeqs in batch
    order; rows past them are padding with neutral values); T: history width; Q: query
    width (prompt logprobs, in a prefill step)."""
    seqs = [r.seq for r in rows]
    ents = [_entries(s, eos_ids) for s in seqs]
    multi = [[w for w in s.bad_words_ids if len(w) > 1] for s in seqs]
    # Smallest buckets large enough for common requests (a few stop ids, biases, a short
    # whitelist or bad-word list): a longer list compiles its power-of-two bucket once.
    E = _pow2(max((len(e) for e in ents), default=0), 64)
    NW = _pow2(max((len(m) for m in multi), default=0), 4)
    LW = _pow2(max((len(w) for m in multi for w in m), default=0), 4)
    hist = np.full((B, T), -1, np.int32)
    n_prompt, n_hist, min_tok = (np.zeros((B,), np.int32) for _ in range(3))
    want_plp = prefill and any(s.params.prompt_logprobs is not None for s in seqs)
    prompt_next = np.full((B, Q if want_plp else 0), -1, np.int32)
    rep = np.ones((B,), np.float32)
    freq, pres, min_p = (np.zeros((B,), np.float32) for _ in range(3))
    has_allowed = np.zeros((B,), bool)
    ent_ids = np.full((B, E), -1, np.int32)
    ent_kind = np.zeros((B, E), np.int32)
    ent_val = np.zeros((B, E), np.float32)
    bw = np.full((B, NW, LW), -1, np.int32)
    for b, s in enumerate(seqs):
        p = s.params
        toks = s.token_ids[:T]
        hist[b, : len(toks)] = toks
        n_prompt[b], n_hist[b] = len(s.prompt_token_ids), len(toks)
        min_tok[b] = p.min_tokens
        rep[b], freq[b], pres[b] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        min_p[b] = p.min_p
        has_allowed[b] = p.allowed_token_ids is not None
        if want_plp and p.prompt_logprobs is not None:
            start, n_p = s.num_computed, len(s.prompt_token_ids)
            nxt = s.prompt_token_ids[start + 1 : min(start + 1 + rows[b].num_new, n_p)]
            prompt_next[b, : len(nxt)] = nxt
        for i, (t, k, v) in enumerate(ents[b]):
            ent_ids[b, i], ent_kind[b, i], ent_val[b, i] = t, k, v
        for i, w in enumerate(multi[b]):
            bw[b, i, LW - len(w):] = w
    return ProcInput(hist, n_prompt, n_hist, min_tok, rep, freq, pres, min_p, has_allowed, ent_ids, ent_kind,
                     ent_val, bw, prompt_next)

