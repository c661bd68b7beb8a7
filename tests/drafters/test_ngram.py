"""The n-gram drafter (vLLM's "ngram") against a brute-force statement of vLLM's rule: the
longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n tokens occurred before,
its earliest occurrence, the tokens after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import family
from jspec.config import load_model_config
from jspec.drafters.ngram import TokenHistory, ngram_config
from jspec.drafters.propose import ProposeInputs, slots_for
from jspec.drafters.registry import make_drafter
from jspec.kv_cache import AttentionMetadata

PAGE, NPAGES, W = 8, 40, 6  # 6 pages a row: histories up to 48 tokens


def vllm_rule(tokens: list[int], lo: int, hi: int, k: int) -> list[int] | None:
    """The tokens after the earliest earlier occurrence of the longest matching suffix, or None."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for end in range(n - 1, L - 1):  # occurrences ending before the suffix's last token
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return None


def _propose(drafter, cache, rows, pages, start, K):
    """One propose call: row b writes tokens rows[b] at positions start[b] .. (its last pair last)."""
    B, Q = rows.shape
    positions = start[:, None] + np.arange(Q)[None, :]
    valid = rows >= 0
    page_table = jnp.asarray(pages, jnp.int32)
    meta_slots = slots_for(page_table, jnp.asarray(positions, jnp.int32), jnp.asarray(valid), PAGE, NPAGES)

    meta = AttentionMetadata(page_table=page_table, kv_lens=jnp.asarray(start + valid.sum(1), jnp.int32),
                             positions=jnp.asarray(positions, jnp.int32), slot_mapping=meta_slots,
                             causal=jnp.ones((B,), bool))
    inp = ProposeInputs(jnp.asarray(np.maximum(rows, 0), jnp.int32), None, meta,
                        jnp.asarray(np.maximum(valid.sum(1) - 1, 0), jnp.int32), None, None, jnp.zeros((B,), jnp.int32),
                        jnp.zeros((B,), jnp.float32), jnp.asarray(valid.any(1)))
    fn = jax.jit(lambda c, i: drafter.propose({}, c, i, num_tokens=K, with_probs=True))
    return fn(cache, inp)


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 2), (5, 5)])
def test_drafts_follow_vllms_rule_over_paged_histories(lo, hi):
    target = load_model_config(family.TARGET)
    d = make_drafter(ngram_config(target, lo, hi))
    rng = np.random.default_rng(lo * 10 + hi)
    K, B = 5, 4
    cache = TokenHistory.create(NPAGES, PAGE)
    pages = rng.permutation(NPAGES)[: B * W].reshape(B, W)  # each row its own scattered pages
    # Sequences over a small alphabet (matches are common), some with a repeated stretch.
    seqs = []
    for b in range(B):
        s = list(rng.integers(0, 4 if b % 2 else 3, size=int(rng.integers(6, 30))))
        if b in (1, 2):
            s = s + s[:9]
        if b == 3:  # a run at the end: the match's continuation is shorter than K
            s = s + [9] * 6
        seqs.append([int(t) for t in s])
    # Two calls: a "prefill" of all but the last 3 tokens, then a "verification" of the rest
    # (the history written by the first call is read by the second), plus a padding row.
    cut = [len(s) - 3 for s in seqs]
    Q1 = max(cut)
    first = np.full((B, Q1), -1)
    for b, s in enumerate(seqs):
        first[b, : cut[b]] = s[: cut[b]]
    _, _, cache = _propose(d, cache, first, pages, np.zeros(B, int), K)
    second = np.full((B + 1, 4), -1)
    for b, s in enumerate(seqs):
        second[b, :3] = s[cut[b]:]
    pages2 = np.concatenate([pages, np.zeros((1, W), int)])  # the padding row points at page 0
    before = np.asarray(cache.tokens).copy()
    drafts, probs, cache = _propose(d, cache, second, pages2, np.asarray(cut + [0]), K)
    drafts = np.asarray(drafts)
    np.testing.assert_array_equal(np.asarray(probs).argmax(-1), drafts)  # one-hot q
    np.testing.assert_array_equal(np.asarray(probs).sum(-1), 1.0)
    hit = short = 0
    for b, s in enumerate(seqs):
        want = vllm_rule(s, lo, hi, K)
        got = drafts[b].tolist()
        if want is None:
            assert got == [s[-1]] * K, (b, s)  # no match: the last token K times
            continue
        hit += 1
        short += len(want) < K
        # the first len(want) as vLLM's; past the sequence's end the match repeats with its
        # period (vLLM proposes fewer there)
        assert got == [want[i % len(want)] for i in range(K)], (b, s, want, got)
    assert hit >= 2 and short >= 1, (hit, short)
    # every written slot holds its token (the padding row wrote nothing: page 0 unchanged
    # unless a real row owns it)
    hist = np.asarray(cache.tokens).reshape(-1)
    for b, s in enumerate(seqs):
        slots = pages[b][np.arange(len(s)) // PAGE] * PAGE + np.arange(len(s)) % PAGE
        assert hist[slots].tolist() == s
    if 0 not in pages:
        np.testing.assert_array_equal(np.asarray(cache.tokens)[0], before[0])


def test_lookahead_and_page_hashing():
    d = make_drafter(ngram_config(load_model_config(family.TARGET), 1, 3))
    assert d.lookahead(7) == 0  # only the verified pairs' own slots are written
    assert d.reads_next_token  # slot p holds the token at p + 1: pages hash the token after them
    d.check_num_tokens(64)
