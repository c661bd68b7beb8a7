"""DFlash drafter parity against speculators; speculators vs z-lab layouts (layer-id offset)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafters import DFlashDrafter, create_kv_cache, load_drafter
from jspec.drafters.convert import speculators_dflash_to_zlab
from jspec.drafters.dflash import dflash_propose
from jspec.drafters.propose import ProposeInputs
from jspec.kv_cache import AttentionMetadata
from tests.helpers.drafters import (
    NPAGES,
    PAGE,
    PAGES,
    V,
    dflash_block_logits,
    make_target,
    randomize,
    ref_dflash,
    rel,
    speculators_config,
    target_aux,
)

AUX = [1, 3]  # canonical (speculators); z-lab writes [0, 2]
T, BS, MASK = 10, 4, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf, tcfg, tparams = make_target(str(tmp_path_factory.mktemp("qwen3_target")), "qwen3", 4)
    ids = np.random.RandomState(3).randint(0, V, size=T + 1)
    return hf, tcfg, tparams, ids


@pytest.fixture(scope="module", params=[V, 96], ids=["full_vocab", "reduced_vocab"])
def drafter(request, target, tmp_path_factory):
    from speculators.models.dflash import DFlashDraftModel

    sc = speculators_config("dflash", "qwen3", 2, BS - 1, draft_vocab_size=request.param, mask_token_id=MASK,
                            block_size=BS, aux_hidden_state_layer_ids=AUX)
    model = randomize(DFlashDraftModel(sc), target[0], request.param, seed=7)
    folder = str(tmp_path_factory.mktemp("dflash"))
    model.save_pretrained(folder)
    return model, folder


def reference(model, aux, bonus):
    return ref_dflash(model, aux, np.arange(T), [bonus] + [MASK] * (BS - 1), np.arange(T, T + BS))


def test_logits_match_speculators(target, drafter):
    _, tcfg, tparams, ids = target
    model, folder = drafter
    cfg, params = load_drafter(folder, tcfg)
    assert cfg.aux_layer_ids == tuple(AUX) and cfg.block_size == BS and cfg.num_speculative_tokens == BS - 1
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    got = dflash_block_logits(cfg, params, tparams, aux, int(ids[T]))
    want = reference(model, aux, int(ids[T]))
    assert rel(got, want) < 1e-4


def test_zlab_layout_same_logits_and_offset_matters(target, drafter, tmp_path):
    _, tcfg, tparams, ids = target
    model, folder = drafter
    z = speculators_dflash_to_zlab(folder, str(tmp_path / "zlab"))
    with open(os.path.join(z, "config.json")) as f:
        zc = json.load(f)
    assert zc["dflash_config"]["target_layer_ids"] == [0, 2]
    cfg, params = load_drafter(z, tcfg)
    assert cfg.source_format == "zlab-dflash" and cfg.aux_layer_ids == tuple(AUX)
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    want = reference(model, aux, int(ids[T]))
    assert rel(dflash_block_logits(cfg, params, tparams, aux, int(ids[T])), want) < 1e-4
    # Reading z-lab ids as canonical (no +1) feeds the wrong target layers.
    wrong_aux = target_aux(tcfg, tparams, ids[:T], [0, 2])
    assert rel(dflash_block_logits(cfg, params, tparams, wrong_aux, int(ids[T])), want) > 1e-2


def test_propose_drafts(target, drafter):
    _, tcfg, tparams, ids = target
    model, folder = drafter
    cfg, params = load_drafter(folder, tcfg)
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    want = reference(model, aux, int(ids[T]))[1:].argmax(-1)
    d2t = model.d2t.numpy() if model.d2t is not None else np.zeros(V, np.int64)
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, T, NPAGES)
    pairs = np.asarray(ids[1 : T + 1])[None]  # pair tokens; the bonus one, ids[T], at last_idx = T - 1
    inputs = ProposeInputs(jnp.asarray(pairs), jnp.asarray(aux[None]), meta, jnp.asarray([T - 1]),
                           tparams["embed_tokens"]["embedding"], tparams["lm_head"], jnp.asarray([0]),
                           jnp.asarray([0.0]), jnp.asarray([True]))
    drafts, probs, _ = dflash_propose(DFlashDrafter(cfg), params, kv, inputs, with_probs=True)
    assert np.asarray(drafts)[0].tolist() == (want + d2t[want]).tolist()
    assert np.asarray(probs).shape == (1, BS - 1, V)
    # K < block_size - 1: the same (whole, non-causal) block, only its first K drafts.
    k = BS - 3
    drafts_k, probs_k, _ = dflash_propose(DFlashDrafter(cfg), params, kv, inputs, num_tokens=k, with_probs=True)
    assert np.asarray(drafts_k)[0].tolist() == (want + d2t[want]).tolist()[:k]
    np.testing.assert_allclose(np.asarray(probs_k), np.asarray(probs)[:, :k], rtol=1e-6, atol=1e-7)

