"""Log-probabilities of emitted (and prompt) tokens: computed in the jitted step from the
target's logits at the position that emitted each token, so they are the same with
speculation on and off (verification position j is the plain step that emits token j).

Device: ``logprob_info`` packs, per [row, position], the token's logprob, its rank and the
top ``n_top`` (ids, logprobs) into one i32[..., 2 + 2 * n_top] block (floats by bit
pattern), so a step still reads one array back. ``n_top`` is the engine's
``max_logprobs`` (static: a request asks for any number up to it).
Host: ``logprob_dict`` turns one block into vLLM's {token id: Logprob} for a request.

Modes (vLLM's ``logprobs_mode``): "raw_logprobs" (default): log-softmax of the model's
logits; "processed_logprobs": of the logits the sampler draws from (processors, then for
sampled rows temperature, min_p, top-k and top-p; a greedy row's processed logits are not
divided by a temperature).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.engine.outputs import Logprob
from kernels_pallas import sampling_utils as su

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def sampler_logits(processed, temperature, top_k, top_p):
    """The processed logits as the sampler draws from them: f32[B, Q, V] divided by the
    temperature (sampled rows) with top-k / top-p applied (-inf outside)."""
    thr = su.filter_thresholds(processed, temperature, top_k, top_p, always=True)[..., None]
    inv_t = su.safe_inv_temperature(temperature)[:, None, None]
    return jnp.where(processed >= thr, processed * inv_t, -jnp.inf)


def logprob_info(logits, tokens, n_top: int):
    """i32[B, Q, 2 + 2 n_top]: [logprob bits, rank, top ids (n_top), top logprob bits (n_top)]
    of tokens i32[B, Q] (< 0: unused, any values) under log_softmax(logits f32[B, Q, V]).
    rank: how many tokens have a logprob >= the token's (vLLM's count; 1 = the best)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    t_lp = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)
    rank = jnp.sum(lp >= t_lp, axis=-1, dtype=jnp.int32)[..., None]
    top_lp, top_id = lax.top_k(lp, n_top)

    def bits(a):
        return lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)

    return jnp.concatenate([bits(t_lp), rank, top_id.astype(jnp.int32), bits(top_lp)], axis=-1)


def info_width(n_top: int) -> int:
    return 2 + 2 * n_top


def _floats(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.int32).view(np.float32)


def unpack(block: np.ndarray) -> tuple[float, int, np.ndarray, np.ndarray]:
    """One i32[2 + 2 n_top] block -> (logprob, rank, top ids, top logprobs)."""
    n = (block.shape[-1] - 2) // 2
    return float(_floats(block[:1])[0]), int(block[1]), block[2 : 2 + n], _floats(block[2 + n :])


def logprob_dict(token: int, block: np.ndarray, num: int, decode) -> tuple[dict[int, Logprob], float]:
    """vLLM's {token id: Logprob} for one position: the token itself, then the ``num``
    most likely tokens (rank 1..num; a token among them keeps that rank), and the token's
    logprob. ``decode(id)`` -> its text, or None without a tokenizer."""
    lp, rank, ids, lps = unpack(block)
    d = {int(token): Logprob(lp, rank, decode(int(token)))}
    for i in range(num):
        d[int(ids[i])] = Logprob(float(lps[i]), i + 1, decode(int(ids[i])))
    return d, lp


def record_logprobs(seq, tokens: list[int], blocks, n_top: int, tokenizer):
    """Append the {id: Logprob} of each emitted token (its block i32[F]) to ``seq.logprobs``
    and its logprob to ``seq.cumulative_logprob`` (``logprobs`` = -1: all ``n_top``)."""
    num = n_top if seq.params.logprobs == -1 else seq.params.logprobs
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
    for t, block in zip(tokens, blocks):
        d, lp = logprob_dict(t, block, num, decode)
        seq.logprobs.append(d)
        seq.cumulative_logprob += lp


def record_prompt_logprobs(rows, blocks, n_top: int, tokenizer):
    """After a prefill step (before ``num_computed`` moves on): the {id: Logprob} of each
    prompt token that a computed position predicts, into ``seq.prompt_logprobs`` (position
    -> dict). ``rows``: the step's ScheduledSeqs; ``blocks`` i32[n, P, F] or None."""
    if blocks is None or blocks.shape[1] == 0:
        return
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
    for r, row in zip(rows, blocks):
        s = r.seq
        num = s.params.prompt_logprobs
        if num is None:
            continue
        num = n_top if num == -1 else num
        ids = s.prompt_token_ids
        for i in range(r.num_new):
            pos = s.num_computed + i + 1
            if pos >= len(ids):
                break
            s.prompt_logprobs[pos] = logprob_dict(ids[pos], row[i], num, decode)[0]
