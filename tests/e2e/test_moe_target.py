"""A Qwen3 mixture-of-experts target (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B) through the
engine: greedy output equals transformers', and speculative greedy equals plain greedy with
an EAGLE3 drafter (speculators) reading its hidden states and with the n-gram method.
Its config translation (which layers have experts) and its errors. The logits and hidden
states against transformers: tests/models/test_transformer_parity.py (the qwen3_moe target).

The target carries the planted feature of tests/helpers/spec_e2e.py (its docstring): no
layer reads or writes residual dimension F (the experts' down rows at F are zero), so the
drafter agrees with it often enough for accepts to happen."""

from __future__ import annotations

import os

import pytest
import torch

import jspec
from jspec.config import ConfigError, model_config_from_hf
from jspec.parallel.mesh import check_target
from tests.helpers import spec_e2e as h
from tests.helpers.drafters import fill_random
from tests.helpers.targets import hf_greedy

MAX_TOKENS = 16
PROMPTS = h.varied_prompts(6, 1, 40, seed=5)
ENGINE_KW = {**h.ENGINE_KW, "num_pages": 8}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(folder, torch model, EAGLE3 drafter folder): a 4-layer Qwen3-MoE target, 8 experts and 2
    a token, layer 2 dense (mlp_only_layers), with the planted feature."""
    from speculators.models import Eagle3DraftModel
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=h.V, hidden_size=h.H, intermediate_size=96, moe_intermediate_size=48,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2],
                         num_hidden_layers=h.L, num_attention_heads=h.HEADS, num_key_value_heads=h.KVH,
                         head_dim=h.HD, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        fill_random(m, scale=0.15)
        m.model.embed_tokens.weight[:, h.F] = h.C_EMBED
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.o_proj.weight[h.F, :] = 0.0
            down = layer.mlp.down_proj.weight if i == 2 else layer.mlp.experts.down_proj  # [E, H, I] stacked
            down[..., h.F, :] = 0.0
            layer.input_layernorm.weight[h.F] = 0.0
            layer.post_attention_layernorm.weight[h.F] = 0.0
        m.lm_head.weight[h.X, h.F] += h.A_TARGET
    folder = os.path.join(root, "target")
    m.save_pretrained(folder)
    sc = h._spec_config("eagle3", "llama", 1, 3, draft_vocab_size=h.DRAFT_VOCAB, norm_before_residual=True,
                        eagle_aux_hidden_state_layer_ids=h.AUX)
    drafter = os.path.join(root, "eagle3")
    h._randomize(Eagle3DraftModel(sc), m, h.DRAFT_VOCAB, seed=1, fc_col=h.F).save_pretrained(drafter)
    return folder, m, drafter


def test_plain_greedy_equals_transformers(moe):
    folder, hf, _ = moe
    llm = jspec.LLM(folder, **ENGINE_KW)
    assert llm.engine.runner.cfg.moe_layers == (0, 1, 3)
    outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(hf, p, MAX_TOKENS), f"prompt of length {len(p)}"


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculative_greedy_equals_plain(moe, method):
    folder, hf, drafter = moe
    spec = ({"method": "eagle3", "model": drafter, "num_speculative_tokens": 3} if method == "eagle3"
            else h.spec_config("ngram", 3))
    llm = jspec.LLM(folder, speculative_config=spec, **ENGINE_KW)
    eng = llm.engine
    before = eng.stats()
    outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(hf, p, MAX_TOKENS), f"prompt of length {len(p)}"
    d = h.stats_delta(before, eng.stats())
    assert d["mean_acceptance_length"] > 1.3, d  # accepts happened: not every draft rejected


def _hf(**moe):
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, **moe}


def test_config_reads_which_layers_have_experts():
    c = model_config_from_hf(_hf(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert c.family == "qwen3" and c.qk_norm and c.moe_layers == (1, 5) and not c.norm_topk_prob
    renamed = {k: v for k, v in _hf(num_local_experts=4).items() if k != "num_experts"}  # transformers 5's name
    assert model_config_from_hf(renamed).num_experts == 4
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    dense = model_config_from_hf({**{k: v for k, v in _hf().items() if k not in moe_keys},
                                  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert dense.moe_layers == () and dense.num_params() < c.num_params()


@pytest.mark.parametrize("bad,match", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "mixture-of-experts keys"),
])
def test_config_errors_name_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf(_hf(**bad))


def test_tensor_parallelism_is_refused_naming_the_experts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: a mixture-of-experts target \(num_experts=4\)"):
        check_target(model_config_from_hf(_hf()), 2)
