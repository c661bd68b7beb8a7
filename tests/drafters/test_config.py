"""DrafterConfig translation: layouts, defaults, canonical layer ids, and the errors."""

from __future__ import annotations

import pytest

from jspec.config import ConfigError, ModelConfig, RopeConfig
from jspec.drafters.config import drafter_config_from_hf

TARGET = ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                     tie_word_embeddings=False, attention_bias=False, mlp_bias=False, qk_norm=False)
LAYER = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 80,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
EAGLE3_NAMES = frozenset({"fc.weight", "lm_head.weight", "d2t"})


def spec(kind, **kw):
    d = {"speculators_model_type": kind, "transformer_layer_config": dict(LAYER), "draft_vocab_size": 256}
    d.update(kw)
    return d


def original(**kw):
    d = dict(LAYER, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=96)
    d.update(kw)
    return d


def zlab(**kw):
    d = dict(LAYER, model_type="qwen3", architectures=["DFlashDraftModel"], block_size=8,
             dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2, 4]})
    d.update(kw)
    return d


def test_eagle3_defaults():
    c = drafter_config_from_hf(spec("eagle3"), TARGET, frozenset())
    assert c.aux_layer_ids == (2, 3, 3)  # [2, L//2, L-3] for L = 6
    assert c.norm_before_residual is True and not c.has_d2t and not c.has_own_embeddings
    assert c.rope.theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.num_speculative_tokens is None
    p = drafter_config_from_hf(spec("peagle", mask_token_id=3), TARGET, frozenset({"mask_hidden"}))
    assert p.norm_before_residual is False
    assert drafter_config_from_hf(spec("peagle", mask_token_id=3, norm_before_residual=True), TARGET,
                                  frozenset({"mask_hidden"})).norm_before_residual is True


def test_speculative_tokens_from_proposal():
    sc = {"default_proposal_method": "greedy", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}]}
    assert drafter_config_from_hf(spec("eagle3", speculators_config=sc), TARGET, frozenset()).num_speculative_tokens == 5
    # DFlash (speculators): the proposal's K, as vLLM reads it, within the block; without one, the whole block.
    dflash = dict(aux_hidden_state_layer_ids=[1, 3, 5], block_size=8, mask_token_id=5)
    c = drafter_config_from_hf(spec("dflash", speculators_config=sc, **dflash), TARGET, frozenset())
    assert (c.num_speculative_tokens, c.block_size) == (5, 8)
    assert drafter_config_from_hf(spec("dflash", **dflash), TARGET, frozenset()).num_speculative_tokens == 7
    sc["proposal_methods"][0]["speculative_tokens"] = 8
    with pytest.raises(ConfigError, match="speculative_tokens=8 must be in 1..block_size - 1"):
        drafter_config_from_hf(spec("dflash", speculators_config=sc, **dflash), TARGET, frozenset())


def test_original_layout():
    c = drafter_config_from_hf(original(), TARGET, EAGLE3_NAMES)
    assert (c.method, c.source_format, c.draft_vocab_size, c.has_d2t) == ("eagle3", "eagle3-original", 96, True)
    with pytest.raises(ConfigError, match="d2t"):
        drafter_config_from_hf(original(), TARGET, frozenset({"fc.weight"}))


def test_dflash_layer_ids():
    z = drafter_config_from_hf(zlab(), TARGET, frozenset())
    assert z.aux_layer_ids == (1, 3, 5) and z.block_size == 8 and z.num_speculative_tokens == 7 and z.qk_norm
    s = drafter_config_from_hf(spec("dflash", aux_hidden_state_layer_ids=[1, 3, 5], block_size=8, mask_token_id=5),
                               TARGET, frozenset())
    assert s.aux_layer_ids == (1, 3, 5) and s.uses_target_lm_head
    with pytest.raises(ConfigError, match="target_layer_ids"):
        drafter_config_from_hf(zlab(dflash_config={"mask_token_id": 5}), TARGET, frozenset())
    with pytest.raises(ConfigError, match="aux_hidden_state_layer_ids"):
        drafter_config_from_hf(spec("dflash", block_size=8, mask_token_id=5), TARGET, frozenset())


def test_dflash2_rejected():
    with pytest.raises(ConfigError, match="DFlash2DraftModel"):
        drafter_config_from_hf(zlab(architectures=["DFlash2DraftModel"]), TARGET, frozenset())
    with pytest.raises(ConfigError, match="dflash2"):
        drafter_config_from_hf(spec("dflash2"), TARGET, frozenset())


def test_peagle_needs_mask_hidden():
    with pytest.raises(ConfigError, match="mask_hidden"):
        drafter_config_from_hf(spec("peagle", mask_token_id=3), TARGET, frozenset())


@pytest.mark.parametrize("change, match", [
    ({"target_hidden_size": 128}, "target hidden size 128"),
    ({"transformer_layer_config": dict(LAYER, vocab_size=300)}, "vocab"),
    ({"transformer_layer_config": dict(LAYER, hidden_size=32, head_dim=8)}, "hidden"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, r"\[7\] out of range \[0, 6\]"),
])
def test_target_mismatch(change, match):
    with pytest.raises(ValueError, match=match):
        drafter_config_from_hf(spec("eagle3", **change), TARGET, frozenset())


def test_unsupported_flags_and_unknown_drafters():
    with pytest.raises(ConfigError, match="norm_output"):
        drafter_config_from_hf(spec("eagle3", norm_output=True), TARGET, frozenset())
    with pytest.raises(ConfigError, match="not a recognised drafter"):
        drafter_config_from_hf(dict(LAYER, architectures=["LlamaForCausalLM"]), TARGET, frozenset())
    assert hash(drafter_config_from_hf(spec("eagle3"), TARGET, frozenset())) is not None
