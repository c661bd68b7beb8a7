"""SpeculativeConfig: construction, vLLM key names, validation errors."""

import pytest

from jspec.speculative_config import SpeculativeConfig


def test_defaults_and_from_dict():
    c = SpeculativeConfig.from_dict({"method": "eagle3", "model": "m", "num_speculative_tokens": 3})
    assert c.enabled and c.rejection_sample_method == "standard" and c.draft_sample_method == "greedy"
    assert not SpeculativeConfig.from_dict(None).enabled
    hash(c)  # frozen and hashable: usable as a static jit argument


def test_synthetic_rates_and_length():
    c = SpeculativeConfig.from_dict({
        "method": "dflash", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.9, 0.5, 0.2]})
    assert c.synthetic_acceptance_rates == (0.9, 0.5, 0.2)
    assert c.synthetic_conditional_rates == pytest.approx((0.9, 0.5 / 0.9, 0.2 / 0.5))
    c = SpeculativeConfig(method="eagle3", num_speculative_tokens=3,
                          rejection_sample_method="synthetic", synthetic_acceptance_length=2.6)
    assert c.synthetic_unconditional_rates == pytest.approx((1.0, 0.6, 0.0))
    assert c.synthetic_conditional_rates == pytest.approx((1.0, 0.6, 0.0))


def test_resolved_fills_k_and_validates():
    c = SpeculativeConfig(method="eagle3", rejection_sample_method="synthetic",
                          synthetic_acceptance_length=3.5)
    with pytest.raises(ValueError, match="resolved"):
        _ = c.synthetic_conditional_rates
    r = c.resolved(4)
    assert r.num_speculative_tokens == 4
    assert r.synthetic_unconditional_rates == pytest.approx((1, 1, 0.5, 0))
    with pytest.raises(ValueError, match="synthetic_acceptance_length"):
        c.resolved(2)  # 3.5 > K + 1 = 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3).resolved(4)


def test_vllm_keys_taken_logged_or_refused(caplog):
    """vLLM's other speculative_config keys: max_model_len is honoured, the keys with nothing
    to set here are logged with the reason, those jspec takes at vLLM's default only are
    refused at any other value, naming the key."""
    import logging

    with caplog.at_level(logging.INFO, logger="jspec"):
        c = SpeculativeConfig.from_dict({"method": "eagle3", "model": "m", "max_model_len": 2048,
                                         "disable_padded_drafter_batch": True, "quantization": None,
                                         "revision": None, "speculative_token_tree": None})
    assert c.max_model_len == 2048
    assert "disable_padded_drafter_batch=True has no effect in jspec" in caplog.text
    for key, value, why in [("quantization", "fp8", "unquantized"), ("revision", "main", "no model hub"),
                            ("speculative_token_tree", "[(0,), (1,)]", "not a tree")]:
        with pytest.raises(ValueError, match=f"speculative_config {key}=.* is not supported: .*{why}"):
            SpeculativeConfig.from_dict({"method": "eagle3", key: value})
    # dynamic speculation's keys: vLLM's disable_by_batch_size and jspec's dynamic
    c = SpeculativeConfig.from_dict({"method": "eagle3", "disable_by_batch_size": 4, "dynamic": False})
    assert (c.disable_by_batch_size, c.dynamic) == (4, False)
    for key, value in [("disable_by_batch_size", 1), ("disable_by_batch_size", "4"), ("dynamic", 1), ("dynamic", None)]:
        with pytest.raises(ValueError, match=f"'{key}' must be"):
            SpeculativeConfig.from_dict({"method": "eagle3", key: value})
    # a method jspec lacks is named before its own keys are (vLLM's suffix decoding)
    with pytest.raises(ValueError, match="'method' must be one of .* got 'suffix'"):
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3,
                                     "suffix_decoding_max_tree_depth": 24})


@pytest.mark.parametrize("d, lookup", [
    ({"method": "ngram", "num_speculative_tokens": 3}, (5, 5)),  # vLLM's defaults
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, (4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, (2, 2)),
    ({"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, (1, 3)),
    ({"method": "ngram_gpu", "num_speculative_tokens": 3}, (5, 5)),
    ({"model": "[ngram]", "num_speculative_tokens": 3}, (5, 5)),  # vLLM's older spelling, no method
])
def test_ngram_spellings_and_lookup_defaults_are_vllms(d, lookup):
    c = SpeculativeConfig.from_dict(d)
    assert (c.method, c.model, c.num_speculative_tokens) == ("ngram", None, 3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == lookup


@pytest.mark.parametrize("d, match", [
    ({"method": "ngram"}, "'num_speculative_tokens' is required with method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "'prompt_lookup_min'=4 must be <= 'prompt_lookup_max'=2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "'prompt_lookup_max' must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/ckpt/eagle3"}, "'model' has no use with method 'ngram'"),
    ({"method": "eagle3", "prompt_lookup_max": 3}, "'prompt_lookup_max' is only valid with method 'ngram'"),
])
def test_ngram_errors_name_the_key(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)


@pytest.mark.parametrize("d, match", [
    ({"method": "eagle3", "bogus_key": 1}, "bogus_key"),
    ({"method": "eagle3", "max_model_len": 0}, "max_model_len"),
    ({"method": "medusa"}, "method"),
    ({"method": "eagle3", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle3", "rejection_sample_method": "strict"}, "rejection_sample_method"),
    ({"method": "eagle3", "draft_sample_method": "topk"}, "draft_sample_method"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [0.5, 0.2]},
     "synthetic_acceptance_rates"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0},
     "synthetic_acceptance_length"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
     "neither"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.2], "synthetic_acceptance_length": 1.5}, "both"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5]}, "2 entries"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [1.5, 0.2]}, r"outside \[0, 1\]"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.2, 0.5]}, "non-increasing"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 3.5}, r"\[1, 3\]"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 0.5}, "synthetic_acceptance_length"),
    ({"method": "eagle3", "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.2, 0.5]}, "non-increasing"),
    ({"method": "eagle3", "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 0.9}, ">= 1"),
])
def test_invalid_configs_raise(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)
