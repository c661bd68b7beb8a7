"""Tiny HF targets written by transformers' save_pretrained (conftest.py's fixtures serve
them), and random prompts over their vocabulary.

Weights are re-drawn with a larger scale than HF's init so logits have clear margins and
greedy continuations vary (HF's 0.02 init gives near-uniform, repetitive outputs).
"""

from __future__ import annotations

import os

import numpy as np

VOCAB = 384
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_config(kind: str):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama_tied":  # llama3 rope scaling + tied embeddings
        return LlamaConfig(**common, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=True)
    if kind == "llama_untied":  # untied, GQA, attention/MLP bias
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    if kind == "qwen3":  # q/k norms, head_dim != hidden / heads
        return Qwen3Config(**{**common, "num_hidden_layers": 3}, head_dim=24, tie_word_embeddings=False)
    if kind == "qwen3_moe":  # 8 experts, 2 a token, renormalised; layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
    raise KeyError(kind)


def build_hf_model(kind: str, seed: int = 0, scale: float = 0.15):
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from tests.helpers.drafters import fill_random

    torch.manual_seed(seed)
    cfg = hf_config(kind)
    cls = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}.get(kind, LlamaForCausalLM)
    model = cls(cfg).eval()
    with torch.no_grad():
        fill_random(model, scale=scale)
    return model


_BUILT: dict = {}


def hf_checkpoint(root, kind: str):
    """(folder, torch model) for a tiny checkpoint, built once per session."""
    if kind not in _BUILT:
        model = build_hf_model(kind)
        folder = os.path.join(str(root), kind)
        model.save_pretrained(folder)
        _BUILT[kind] = (folder, model)
    return _BUILT[kind]


def random_prompt(rng: np.random.Generator, n: int, vocab: int = VOCAB) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def hf_greedy(hf, prompt, n):
    """transformers' greedy continuation: ``n`` tokens of ``prompt``, EOS ignored."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
