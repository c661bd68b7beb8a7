"""The Drafter registry: what the engine asks of a drafter method without branching on its name."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re

import pytest

from jspec import family
from jspec.config import ConfigError, load_model_config
from jspec.drafters.config import detect_format, drafter_config_from_hf
from jspec.drafters.loader import _dummy_tensor_names
from jspec.drafters.registry import REGISTRY, make_drafter, method_names
from jspec.speculative_config import SpeculativeConfig


def _family_cfg(method: str):
    target = load_model_config(family.TARGET)
    with open(os.path.join(family.ROOT, method, "config.json")) as f:
        d = json.load(f)
    return drafter_config_from_hf(d, target, _dummy_tensor_names(*detect_format(d)))


def test_the_registry_is_the_one_list_of_method_names():
    """speculative_config and the drafter config translation name the registry's methods,
    in its order, with their messages of before."""
    assert method_names() == ("eagle3", "peagle", "dflash", "ngram", "draft_model") == tuple(REGISTRY)
    with pytest.raises(ValueError, match=re.escape(
            "'method' must be one of ('eagle3', 'peagle', 'dflash', 'ngram', 'draft_model') or None, got 'medusa'")):
        SpeculativeConfig(method="medusa")
    # A drafter config.json names the methods with a checkpoint translation (Method.from_hf).
    with pytest.raises(ConfigError, match=re.escape("supported: ['eagle3', 'peagle', 'dflash']")):
        detect_format({"speculators_model_type": "ngram"})
    with pytest.raises(ConfigError, match="expected a speculators eagle3/peagle/dflash config, "
                                          "LlamaForCausalLMEagle3 or DFlashDraftModel"):
        detect_format({"architectures": ["LlamaForCausalLM"]})
    assert detect_format({"architectures": ["DFlashDraftModel"]}) == ("dflash", "zlab-dflash")
    assert detect_format({"architectures": ["LlamaForCausalLMEagle3"]}) == ("eagle3", "eagle3-original")
    # each method module's entry, registered once
    for name, m in REGISTRY.items():
        assert m is importlib.import_module(f"jspec.drafters.{name}").METHOD


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_lookahead_and_page_hashing_follow_the_method(method):
    cfg = _family_cfg(method)
    d = make_drafter(cfg)
    assert d.cfg is cfg and d.module.cfg is cfg
    # EAGLE-style heads write K - 1 slots past the bonus pair (plus its own); DFlash a block.
    assert d.lookahead(3) == (cfg.block_size if method == "dflash" else 3)
    assert d.reads_next_token == (method != "dflash")


def test_num_tokens_beyond_a_dflash_block_is_an_error_naming_it():
    cfg = _family_cfg("dflash")
    d = make_drafter(cfg)
    d.check_num_tokens(cfg.block_size - 1)
    with pytest.raises(ValueError, match=f"num_speculative_tokens={cfg.block_size} exceeds the DFlash block"):
        d.check_num_tokens(cfg.block_size)
    make_drafter(_family_cfg("eagle3")).check_num_tokens(64)  # a chain drafts any K


def test_unknown_method_is_an_error_naming_the_known_ones():
    cfg = dataclasses.replace(_family_cfg("eagle3"), method="medusa")
    with pytest.raises(ValueError, match=r"'medusa' is not supported \(known: \['dflash', 'draft_model', 'eagle3', 'ngram', 'peagle'\]\)"):
        make_drafter(cfg)


def test_a_method_without_checkpoint_tensors_has_no_param_spec():
    from jspec.drafters.loader import drafter_param_spec
    from jspec.drafters.ngram import ngram_config

    with pytest.raises(ValueError, match=r"the n-gram method has no drafter checkpoint tensors"):
        drafter_param_spec(ngram_config(load_model_config(family.TARGET), 1, 3))
