"""The target: a plain causal Llama trained on the corpus, saved as a HF Llama folder.

The HF ``config.json`` is written first and translated by jspec.config (the one
translation), so the trained shapes are exactly what the loaders will expect; the tree is
jspec's own (fused qkv and gate|up) and is written back to HF tensor names through
``target_param_spec``. jspec.LLM and transformers' LlamaForCausalLM both load the folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import optax

from jspec.checkpoint.target import target_param_spec
from jspec.config import ModelConfig, model_config_from_hf
from jspec.train.layers import cast_tree, causal_mask, check_trainable, decoder_layer, rms_norm, rope
from jspec.train.loop import check_tree, init_params, save_safetensors, tensors_from_specs


@dataclasses.dataclass(frozen=True)
class TargetSize:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0


# "small": the family's target (~10.5M parameters at vocab 8192, untied); "tiny": tests.
PRESETS = {
    "small": TargetSize(),
    "tiny": TargetSize(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=512),
}


def hf_config(size: TargetSize, *, bos_id: int, eos_ids: list[int], dtype: str = "float32") -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": size.max_position_embeddings,
        "rope_theta": size.rope_theta,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": list(eos_ids),
        "torch_dtype": dtype,
    }


def init_target(c: ModelConfig, key) -> dict:
    check_trainable(c)
    return init_params(target_param_spec(c), key, num_layers=c.num_layers)


def forward(params, c: ModelConfig, tokens, aux_layers: tuple[int, ...] = (), dtype=jnp.float32):
    """tokens: i32[B, T] at positions 0..T-1, causal.
    -> (final-normed hidden [B, T, H], aux [B, T, len(aux_layers), H] at canonical indices | None)."""
    p = cast_tree(params, dtype)
    B, T = tokens.shape
    x = jnp.take(p["embed_tokens"]["embedding"], tokens, axis=0)
    cos, sin = rope(c, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    mask = causal_mask(T)
    captured = {}
    for i in range(c.num_layers):
        captured[i] = x
        x, _ = decoder_layer(c, p[f"layers_{i}"], x, cos, sin, mask)
    captured[c.num_layers] = x
    aux = jnp.stack([captured[a] for a in aux_layers], axis=2) if aux_layers else None
    return rms_norm(x, p["norm"]["weight"], c.rms_norm_eps), aux


def logits(params, c: ModelConfig, h):  # h: final-normed [..., H] -> f32[..., V]
    w = params["embed_tokens"]["embedding"] if c.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("...h,vh->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def lm_loss(params, frozen, tokens, key, *, cfg: ModelConfig, dtype=jnp.float32):
    """Next-token cross entropy over every position of the packed rows (tokens: i32[B, T])."""
    del frozen, key
    h, _ = forward(params, cfg, tokens, dtype=dtype)
    lg = logits(params, cfg, h[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(lg, tokens[:, 1:])
    acc = jnp.mean(jnp.argmax(lg, -1) == tokens[:, 1:])
    return jnp.mean(nll), {"acc": acc}


def loss_fn(cfg: ModelConfig, dtype=jnp.float32):
    return functools.partial(lm_loss, cfg=cfg, dtype=dtype)


def save_target(params, config: dict, folder: str, dtype: str = "float32"):
    """config.json (+ generation_config.json) and model.safetensors with HF tensor names."""
    cfg = model_config_from_hf(config)
    specs = target_param_spec(cfg)
    check_tree(params, specs)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": dtype}, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f, indent=2)
    save_safetensors(tensors_from_specs(params, specs, jnp.dtype(dtype)), folder)


def num_params(params) -> int:
    return int(sum(a.size for a in jax.tree.leaves(params)))
