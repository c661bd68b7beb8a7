"""EAGLE3 drafter parity against speculators (PyTorch), both checkpoint layouts, propose loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafters import Eagle3Drafter, create_kv_cache, load_drafter
from jspec.drafters.convert import speculators_eagle3_to_original
from jspec.drafters.eagle3 import draft_probs_to_target, eagle3_propose
from jspec.drafters.propose import ProposeInputs
from jspec.kv_cache import AttentionMetadata
from tests.helpers.drafters import (
    NPAGES,
    PAGE,
    PAGES,
    V,
    eagle3_first_pass,
    make_target,
    randomize,
    ref_eagle3,
    rel,
    speculators_config,
    target_aux,
)

AUX = [1, 3, 6]  # canonical; 6 = the last layer's output of the 6-layer target
T = 12
# name -> (draft vocab, norm_before_residual, drafter layers)
CASES = {
    "reduced_nbr": (96, True, 1),
    "full_plain": (V, False, 1),
    "reduced_2layers": (96, False, 2),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf, cfg, params = make_target(str(tmp_path_factory.mktemp("llama_target")), "llama", 6)
    ids = np.random.RandomState(1).randint(0, V, size=T + 1)
    return hf, cfg, params, ids, target_aux(cfg, params, ids[:T], AUX)


@pytest.fixture(scope="module", params=list(CASES))
def drafter(request, target, tmp_path_factory):
    from speculators.models import Eagle3DraftModel

    vocab, nbr, layers = CASES[request.param]
    hf = target[0]
    sc = speculators_config("eagle3", "llama", layers, 4, draft_vocab_size=vocab, norm_before_residual=nbr,
                            eagle_aux_hidden_state_layer_ids=AUX)
    model = randomize(Eagle3DraftModel(sc), hf, vocab, seed=len(request.param))
    folder = str(tmp_path_factory.mktemp(f"eagle3_{request.param}"))
    model.save_pretrained(folder)
    return request.param, model, folder


def test_config_translation(target, drafter):
    name, model, folder = drafter
    cfg, _ = load_drafter(folder, target[1])
    vocab, nbr, layers = CASES[name]
    assert (cfg.method, cfg.aux_layer_ids, cfg.draft_vocab_size, cfg.num_layers) == ("eagle3", tuple(AUX), vocab, layers)
    assert cfg.norm_before_residual == nbr and cfg.has_d2t == (vocab != V) and cfg.has_own_embeddings
    assert cfg.num_speculative_tokens == 4 and hash(cfg) == hash(cfg)


def test_logits_match_speculators(target, drafter):
    _, tcfg, tparams, ids, aux = target
    name, model, folder = drafter
    cfg, params = load_drafter(folder, tcfg)
    tokens = ids[1 : T + 1]  # token t+1 paired with target hidden t
    got, pre = eagle3_first_pass(cfg, params, tparams, tokens, aux)
    want, want_pre = ref_eagle3(model, tokens, (aux, None, np.zeros(T, bool)), np.arange(T))
    assert got.shape == (T, CASES[name][0])
    assert rel(got, want) < 1e-4
    assert rel(pre, want_pre) < 1e-4


def test_original_layout_same_logits(target, drafter, tmp_path):
    _, tcfg, tparams, ids, aux = target
    name, model, folder = drafter
    if CASES[name][2] != 1:
        pytest.skip("the original layout holds one layer")
    orig = speculators_eagle3_to_original(folder, str(tmp_path / "orig"), as_bin=name == "full_plain")
    cfg, params = load_drafter(orig, tcfg)
    assert cfg.source_format == "eagle3-original" and not cfg.has_own_embeddings
    assert "embed_tokens" not in params
    got, _ = eagle3_first_pass(cfg, params, tparams, ids[1 : T + 1], aux)
    want, _ = ref_eagle3(model, ids[1 : T + 1], (aux, None, np.zeros(T, bool)), np.arange(T))
    assert rel(got, want) < 1e-4


def test_propose_loop_matches_stepwise_reference(target, drafter):
    """Greedy K-step drafting equals speculators run step by step (feeding pre-norm states back)."""
    _, tcfg, tparams, ids, aux = target
    name, model, folder = drafter
    cfg, params = load_drafter(folder, tcfg)
    K = 4
    tokens = ids[1 : T + 1]
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, T, NPAGES)
    one = lambda x, dt: jnp.asarray([x], dt)  # noqa: E731
    emb = tparams["embed_tokens"]["embedding"]
    drafts, probs, kv = eagle3_propose(
        Eagle3Drafter(cfg), params, kv,
        ProposeInputs(jnp.asarray(tokens[None]), jnp.asarray(aux[None]), meta, one(T - 1, jnp.int32), emb, emb,
                      one(0, jnp.int32), one(0.0, jnp.float32), one(True, bool)),
        num_tokens=K, with_probs=True,
    )
    d2t = model.d2t.numpy() if model.d2t is not None else np.zeros(CASES[name][0], np.int64)
    seq_ids, fc_rows, direct, is_direct = list(tokens), list(aux), [np.zeros(64)] * T, [False] * T
    want = []
    for _ in range(K):
        n = len(seq_ids)
        logits, pre = ref_eagle3(model, np.array(seq_ids), (np.array(fc_rows), np.array(direct), np.array(is_direct)), np.arange(n))
        d = int(np.argmax(logits[-1]))
        want.append(d + int(d2t[d]))
        seq_ids.append(want[-1])
        fc_rows.append(np.zeros_like(aux[0]))
        direct.append(pre[-1])
        is_direct.append(True)
    assert np.asarray(drafts)[0].tolist() == want
    p = np.asarray(probs)[0]
    assert p.shape == (K, V) and np.allclose(p.sum(-1), 1.0)
    assert (p.argmax(-1) == np.array(want)).all()


def test_sampled_drafts_are_in_the_draft_vocab(target, drafter):
    _, tcfg, tparams, ids, aux = target
    name, model, folder = drafter
    cfg, params = load_drafter(folder, tcfg)
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, T, NPAGES)
    emb = tparams["embed_tokens"]["embedding"]
    drafts, probs, _ = eagle3_propose(
        Eagle3Drafter(cfg), params, kv,
        ProposeInputs(jnp.asarray(ids[None, 1 : T + 1]), jnp.asarray(aux[None]), meta, jnp.asarray([T - 1]), emb, emb,
                      jnp.asarray([7]), jnp.asarray([1.0]), jnp.asarray([True])),
        num_tokens=3, with_probs=True,
    )
    p = np.asarray(probs)[0]
    d = np.asarray(drafts)[0]
    assert (p[np.arange(3), d] > 0).all()
    if cfg.has_d2t:
        allowed = np.arange(cfg.draft_vocab_size) + np.asarray(params["d2t"])
        assert set(d.tolist()) <= set(allowed.tolist())
        assert np.count_nonzero(p.sum(0)) <= cfg.draft_vocab_size


def test_draft_probs_to_target_scatter():
    d2t = jnp.asarray([0, 2, 5], jnp.int32)  # draft i -> target i + d2t[i] = 0, 3, 7
    probs = jnp.asarray([[0.5, 0.3, 0.2]])
    out = np.asarray(draft_probs_to_target(probs, d2t, 9))
    assert out.shape == (1, 9)
    assert np.allclose(out[0], [0.5, 0, 0, 0.3, 0, 0, 0, 0.2, 0])


def test_batched_jitted_propose_matches_single_rows(target, drafter):
    """Two padded rows with their own pages under jax.jit give each row's single-sequence drafts."""
    import functools

    import jax

    from jspec.drafters.propose import slots_for

    _, tcfg, tparams, ids, aux = target
    name, model, folder = drafter
    if name != "reduced_nbr":
        pytest.skip("one case is enough for the batching check")
    cfg, params = load_drafter(folder, tcfg)
    drafter_mod, K, emb = Eagle3Drafter(cfg), 3, tparams["embed_tokens"]["embedding"]
    lens = [T, T - 3]

    def single(n):
        kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
        meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, n, NPAGES)
        toks = np.concatenate([ids[1:n], [ids[n]]])
        d, _, _ = eagle3_propose(drafter_mod, params, kv,
                                 ProposeInputs(jnp.asarray(toks[None]), jnp.asarray(aux[None, :n]), meta,
                                               jnp.asarray([n - 1]), emb, emb, jnp.asarray([0]), jnp.asarray([0.0]),
                                               jnp.asarray([True])),
                                 num_tokens=K)
        return np.asarray(d)[0].tolist()

    page_table = jnp.asarray([PAGES[:8], PAGES[8:]], jnp.int32)
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32), (2, 1))
    valid = positions < jnp.asarray(lens)[:, None]
    meta = AttentionMetadata(page_table=page_table, kv_lens=jnp.asarray(lens, jnp.int32), positions=positions,
                             slot_mapping=slots_for(page_table, positions, valid, PAGE, NPAGES),
                             causal=jnp.ones((2,), bool))
    toks = np.zeros((2, T), np.int32)
    for b, n in enumerate(lens):
        toks[b, :n] = np.concatenate([ids[1:n], [ids[n]]])
    fn = jax.jit(functools.partial(eagle3_propose, drafter_mod, num_tokens=K))
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    d, _, _ = fn(params, kv, ProposeInputs(jnp.asarray(toks), jnp.asarray(np.stack([aux, aux])), meta,
                                           jnp.asarray([lens[0] - 1, lens[1] - 1]), emb, emb, jnp.asarray([0, 0]),
                                           jnp.asarray([0.0, 0.0]), jnp.asarray([True, True])))
    assert np.asarray(d).tolist() == [single(lens[0]), single(lens[1])]
