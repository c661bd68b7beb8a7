"""PEagle drafter parity against speculators: the one-forward mask-slot drafting."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.config import ConfigError
from jspec.drafters import PEagleDrafter, create_kv_cache, load_drafter
from jspec.drafters.peagle import peagle_propose
from jspec.drafters.propose import ProposeInputs
from jspec.kv_cache import AttentionMetadata
from tests.helpers.drafters import (
    NPAGES,
    PAGE,
    PAGES,
    V,
    make_target,
    peagle_mask_slot_logits,
    randomize,
    ref_eagle3,
    rel,
    speculators_config,
    target_aux,
)

AUX = [1, 2, 4]
T, K, MASK = 10, 4, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from speculators.models.peagle import PEagleDraftModel

    hf, tcfg, tparams = make_target(str(tmp_path_factory.mktemp("qwen3_target")), "qwen3", 4)
    ids = np.random.RandomState(2).randint(0, V, size=T + 1)
    aux = target_aux(tcfg, tparams, ids[:T], AUX)
    sc = speculators_config("peagle", "qwen3", 2, K, draft_vocab_size=V, mask_token_id=MASK,
                            eagle_aux_hidden_state_layer_ids=AUX)
    model = randomize(PEagleDraftModel(sc), hf, V, seed=5)
    folder = str(tmp_path_factory.mktemp("peagle"))
    model.save_pretrained(folder)
    return tcfg, tparams, ids, aux, model, folder


def reference(model, ids, aux):
    """speculators over [pairs..., MASK x (K-1)] at consecutive positions, causal."""
    tokens = np.concatenate([ids[1 : T + 1], np.full(K - 1, MASK)])
    rows = np.concatenate([aux, np.zeros((K - 1, aux.shape[1]), np.float32)])
    is_mask = np.arange(T + K - 1) >= T
    logits, _ = ref_eagle3(model, tokens, (rows, None, None), np.arange(T + K - 1), mask_slots=is_mask)
    return tokens, is_mask, logits


def test_config(setup):
    tcfg, _, _, _, _, folder = setup
    cfg, params = load_drafter(folder, tcfg)
    assert (cfg.method, cfg.mask_token_id, cfg.num_layers, cfg.qk_norm) == ("peagle", MASK, 2, True)
    assert cfg.norm_before_residual is False and cfg.has_own_embeddings
    assert params["mask_hidden"].shape == (3 * 64,)


def test_mask_slot_forward_matches_speculators(setup):
    tcfg, tparams, ids, aux, model, folder = setup
    cfg, params = load_drafter(folder, tcfg)
    tokens, is_mask, want = reference(model, ids, aux)
    rows = np.concatenate([aux, np.zeros((K - 1, aux.shape[1]), np.float32)])
    got = peagle_mask_slot_logits(cfg, params, tokens, rows, is_mask)
    assert rel(got, want) < 1e-4
    assert rel(got[T:], want[T:]) < 1e-4  # the mask slots themselves


def test_propose_one_forward(setup):
    tcfg, tparams, ids, aux, model, folder = setup
    cfg, params = load_drafter(folder, tcfg)
    _, _, want = reference(model, ids, aux)
    # Pairs padded to Q = T + 2 (the engine's bucket): padding rows drop their writes.
    Q = T + 2
    pad_tokens = np.concatenate([ids[1 : T + 1], [0, 0]])
    pad_aux = np.concatenate([aux, np.full((2, aux.shape[1]), np.nan, np.float32)])
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, Q, NPAGES)
    meta = meta.replace(slot_mapping=meta.slot_mapping.at[0, T:].set(NPAGES * PAGE), kv_lens=jnp.asarray([T]))
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    drafts, probs, _ = peagle_propose(  # own embeddings: no target tables
        PEagleDrafter(cfg), params, kv,
        ProposeInputs(jnp.asarray(pad_tokens[None]), jnp.asarray(pad_aux[None]), meta, jnp.asarray([T - 1]), None,
                      None, jnp.asarray([0]), jnp.asarray([0.0]), jnp.asarray([True])),
        num_tokens=K, with_probs=True,
    )
    assert np.asarray(drafts)[0].tolist() == want[T - 1 :].argmax(-1).tolist()
    assert np.asarray(probs).shape == (1, K, V)


def test_missing_mask_hidden_is_an_error(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    tcfg, _, _, _, _, folder = setup
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["mask_hidden"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    os.symlink(os.path.join(folder, "config.json"), tmp_path / "config.json")
    with pytest.raises(ConfigError, match="mask_hidden"):
        load_drafter(str(tmp_path), tcfg)


def test_wrong_shape_names_both_shapes(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    tcfg, _, _, _, _, folder = setup
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["layers.1.mlp.down_proj.weight"] = tensors["layers.1.mlp.down_proj.weight"][:, :-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    os.symlink(os.path.join(folder, "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.weight.*\[64, 79\].*\[64, 80\]"):
        load_drafter(str(tmp_path), tcfg)


def test_missing_tensor_is_named(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    tcfg, _, _, _, _, folder = setup
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    os.symlink(os.path.join(folder, "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.0\.self_attn\.k_proj\.weight'"):
        load_drafter(str(tmp_path), tcfg)
