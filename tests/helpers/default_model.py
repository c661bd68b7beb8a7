"""A tiny random Llama 3-style model built on first use: the fast model of the CPU tests.

(``jspec.LLM()`` with no model serves the trained family, jspec.family.) No download is
possible on the project's machines, so this builds a HF-format folder (config.json,
model.safetensors, a byte-level tokenizer with jspec's Llama 3 style special tokens and
chat template, those of jspec/train/tokenizer.py) under $JSPEC_CACHE, loaded through the
ordinary checkpoint path. Weights are random (fixed seed): the text is noise, the machinery
is real.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from jspec import envs
from jspec.train.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

VERSION = 2

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,  # 256 bytes + specials, padded
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 256,
    "eos_token_id": [257, 260],
    "torch_dtype": "float32",
}


def cache_dir() -> str:
    """The folder the model is built in: $JSPEC_CACHE (jspec/envs.py)."""
    return envs.JSPEC_CACHE


def _random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": np.ones(H, np.float32)}
    # Dimension 0 of the residual stream: constant 1 in every embedding, never written by
    # a layer (zero rows in o_proj / down_proj), so after the final norm it is a large
    # positive feature; lm_head rows favour printable bytes through it.
    out["model.embed_tokens.weight"][:, 0] = 1.0
    head = w(V, H) * 0.1 / 0.05  # a wider spread so the context, not only the bias, picks the token
    printable = np.zeros(V, bool)
    printable[[ord(c) for c in "abcdefghijklmnopqrstuvwxyz      ,.ETAONIS"]] = True
    head[:, 0] = np.where(printable, 0.0, -4.0)
    out["lm_head.weight"] = head
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": np.ones(H, np.float32),
            f"{p}.post_attention_layernorm.weight": np.ones(H, np.float32),
            f"{p}.self_attn.q_proj.weight": w(nh * D, H),
            f"{p}.self_attn.k_proj.weight": w(nkv * D, H),
            f"{p}.self_attn.v_proj.weight": w(nkv * D, H),
            f"{p}.self_attn.o_proj.weight": _zero_row0(w(H, nh * D)),
            f"{p}.mlp.gate_proj.weight": w(I, H),
            f"{p}.mlp.up_proj.weight": w(I, H),
            f"{p}.mlp.down_proj.weight": _zero_row0(w(H, I)),
        }
    return out


def _zero_row0(m: np.ndarray) -> np.ndarray:
    m[0] = 0.0
    return m


def write_byte_tokenizer(folder: str, vocab_size: int):
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order by the byte each printable stand-in represents, so token id == byte value.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, map(chr, cs)))
    assert set(byte_to_char.values()) == set(byte_chars)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    assert len(fast) <= vocab_size


def build_default_model(folder: str, seed: int = 0):
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    save_file(_random_weights(CONFIG, seed), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_byte_tokenizer(folder, CONFIG["vocab_size"])


def default_model_path() -> str:
    """Path of the embedded default model, built (atomically) on first use."""
    path = os.path.join(cache_dir(), f"default-llama-v{VERSION}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".build-")
    try:
        build_default_model(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
