"""The draft-model method (vLLM's "draft_model"): an ordinary small Llama drafts its own
greedy continuation, as transformers computes it, through the engine's propose call over
paged KV (a prefill-like call, then a verification-like one whose last pair was rejected)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jspec.config import load_model_config
from jspec.drafters.draft_model import load_draft_model
from jspec.drafters.propose import ProposeInputs, slots_for
from jspec.drafters.registry import make_drafter
from jspec.kv_cache import AttentionMetadata
from tests.helpers import spec_e2e as h

PAGE, NPAGES = 8, 12
PAGES = [5, 2, 9, 0]  # one row's scattered pages
K, T = 4, 13


def _meta(start: int, q: int):
    positions = jnp.arange(start, start + q, dtype=jnp.int32)[None]
    table = jnp.asarray([PAGES], jnp.int32)
    return AttentionMetadata(page_table=table, kv_lens=jnp.asarray([start + q], jnp.int32), positions=positions,
                             slot_mapping=slots_for(table, positions, jnp.ones((1, q), bool), PAGE, NPAGES),
                             causal=jnp.ones((1,), bool))


def _inputs(first: int, pairs: list[int], start: int, last_idx: int):
    """The step ran [first, pairs[:-1]] at start ..: its input tokens, each pair one on."""
    z = jnp.zeros((1,), jnp.int32)
    return ProposeInputs(jnp.asarray([pairs], jnp.int32), None, _meta(start, len(pairs)),
                         jnp.asarray([last_idx], jnp.int32), None, None, z, jnp.zeros((1,), jnp.float32),
                         jnp.ones((1,), bool), jnp.asarray([[first] + pairs[:-1]], jnp.int32))


@torch.no_grad()
def _hf_greedy(m, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    m = h.build_target(seed=3, num_layers=2, boost=0.0)  # a random 2-layer Llama
    path = str(tmp_path_factory.mktemp("draft_llama"))
    m.save_pretrained(path)
    return m, path


def test_drafts_are_the_models_greedy_continuation(draft):
    m, path = draft
    dcfg, params = load_draft_model(path, load_model_config(path))
    d = make_drafter(dcfg)
    assert d.lookahead(K) == K + 1 and not d.reads_next_token
    kv = d.create_cache(NPAGES, PAGE, jnp.float32)
    propose = jax.jit(lambda kv, inp: d.propose(params, kv, inp, num_tokens=K, with_probs=True))
    rng = np.random.default_rng(0)
    x = [int(t) for t in rng.integers(3, h.V, size=T + 1)]
    # prefill-like: x_0 at 0, then the pairs (x_{p+1} at p) for p < T; the last pair is x_T
    drafts, probs, kv = propose(kv, _inputs(x[0], x[1:], 0, T - 1))
    assert np.asarray(drafts)[0].tolist() == _hf_greedy(m, x, K)
    np.testing.assert_array_equal(np.asarray(probs)[0].argmax(-1), np.asarray(drafts)[0])  # greedy: one-hot q
    # verification-like: the step ran [x_T, y_0, y_1, y_2] at T..T+3; pairs y_0..y_3 with
    # y_2 the bonus (last_idx 2) and y_3 a rejected slot holding anything
    y = [int(t) for t in rng.integers(3, h.V, size=3)] + [1]
    drafts, _, kv = propose(kv, _inputs(x[T], y, T, 2))
    assert np.asarray(drafts)[0].tolist() == _hf_greedy(m, x + y[:3], K)


def test_a_draft_model_of_another_vocabulary_is_refused(draft, tmp_path):
    _, path = draft
    target = load_model_config(path)
    import dataclasses

    with pytest.raises(ValueError, match=r"share the target's vocabulary, but its vocab_size is 64 and the target's 65"):
        load_draft_model(path, dataclasses.replace(target, vocab_size=65))
