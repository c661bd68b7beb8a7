"""What the three drafter recipes share: the speculators-format config, the parameter
tree (from jspec's drafter_param_spec), the target's training signals, the save.

The config dict is what ``speculators``' ``save_pretrained`` writes (the keys of
tests/helpers/drafters.py ``speculators_config``), with the verifier's path left null:
the drafter ships next to its target and is paired with it by whoever loads both. It is
translated by jspec.drafters.config (the one translation), so shapes, aux ids and flags
are what jspec's loader will read back. The drafter's decoder keeps the target's width,
heads and RoPE, and uses the full target vocabulary (no d2t at an 8K vocab).

Training data is the frozen target run over corpus rows inside the same jitted step:
aux states at the drafter's canonical indices and the target's logits (the distillation
target), never stored.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig, model_config_from_hf
from jspec.drafters.config import DrafterConfig, drafter_config_from_hf
from jspec.drafters.loader import drafter_param_spec
from jspec.train import target as tgt
from jspec.train.loop import check_tree, init_params, save_safetensors, tensors_from_specs

SPECULATORS_VERSION = "0.9.0"  # the format these configs follow (speculators' save_pretrained)
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator", "dflash": "DFlashSpeculator"}


@dataclasses.dataclass(frozen=True)
class DrafterSize:
    method: str  # "eagle3" | "peagle" | "dflash"
    num_layers: int
    intermediate_size: int | None = None  # None: the target's
    num_speculative_tokens: int = 3  # the checkpoint's proposal default (DFlash: at most block_size - 1)
    block_size: int | None = None  # DFlash
    aux_layer_ids: tuple[int, ...] | None = None  # canonical; None: default_aux_layers


DEFAULTS = {
    "eagle3": DrafterSize("eagle3", num_layers=1, num_speculative_tokens=3),
    "peagle": DrafterSize("peagle", num_layers=2, num_speculative_tokens=5),
    "dflash": DrafterSize("dflash", num_layers=2, num_speculative_tokens=7, block_size=8),
}


def default_aux_layers(method: str, tc: ModelConfig) -> tuple[int, ...]:
    """Canonical ids. EAGLE3 / PEagle: EAGLE3's [2, L//2, L-3] where those are distinct and
    increasing (L >= 6), else 1, L//2, L-1. DFlash (which needs explicit ids): 1, L//2, L-1."""
    L = tc.num_layers
    if method != "dflash" and L >= 6:
        return tc.default_aux_layers()
    return (1, L // 2, L - 1)


def speculators_config(size: DrafterSize, target_hf: dict, *, mask_token_id: int | None) -> dict:
    """The drafter's config.json (speculators format) for a target whose HF config is ``target_hf``."""
    m = size.method
    tc = model_config_from_hf(target_hf)
    aux = list(size.aux_layer_ids or default_aux_layers(m, tc))
    layer = {
        "vocab_size": tc.vocab_size,
        "hidden_size": tc.hidden_size,
        "intermediate_size": size.intermediate_size or tc.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": tc.num_heads,
        "num_key_value_heads": tc.num_kv_heads,
        "head_dim": tc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": tc.rms_norm_eps,
        "max_position_embeddings": tc.max_position_embeddings,
        "rope_parameters": {"rope_theta": tc.rope.theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # DFlash layers are Qwen3's (q_norm / k_norm); EAGLE3 / PEagle layers the target's.
        "model_type": "qwen3" if m == "dflash" else "llama",
    }
    if tc.rope.rope_type != "default":
        raise ValueError("drafters are built for targets with default RoPE")
    k = size.num_speculative_tokens
    d = {
        "architectures": [ARCHITECTURES[m]],
        "speculators_model_type": m,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": m,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": list(target_hf["architectures"])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": tc.vocab_size,
        "target_hidden_size": None,
    }
    if m == "dflash":
        if mask_token_id is None or size.block_size is None:
            raise ValueError("a DFlash drafter needs mask_token_id and block_size")
        if not 1 <= k <= size.block_size - 1:
            raise ValueError(f"a DFlash drafter's K ({k}) must be in 1..block_size - 1 ({size.block_size - 1})")
        d |= {"block_size": size.block_size, "aux_hidden_state_layer_ids": aux, "mask_token_id": mask_token_id,
              "sliding_window_non_causal": False, "sample_from_anchor": False}
    else:
        d |= {"norm_before_residual": m == "eagle3", "eagle_aux_hidden_state_layer_ids": aux,
              "norm_before_fc": False, "fc_norm": False, "norm_output": False,
              # EAGLE3 drafts with the target's (frozen) embeddings and ships none; PEagle
              # trains its own.
              "embed_requires_grad": m == "peagle"}
        if m == "peagle":
            if mask_token_id is None:
                raise ValueError("a PEagle drafter needs mask_token_id")
            d["mask_token_id"] = mask_token_id
    return d


def tensor_names(method: str) -> frozenset[str]:
    """The flag-carrying tensors a trained drafter's checkpoint holds (see speculators_config)."""
    return frozenset({"embed_tokens.weight", "mask_hidden"} if method == "peagle" else set())


def drafter_config(d: dict, tc: ModelConfig) -> DrafterConfig:
    return drafter_config_from_hf(d, tc, tensor_names(d["speculators_model_type"]))


def init_drafter(dc: DrafterConfig, tparams, key) -> dict:
    """Random drafter tree; lm_head (and PEagle's embeddings) start as the target's copies."""
    if dc.has_d2t or dc.attention_bias or dc.mlp_bias or dc.norm_before_fc:
        raise ValueError("jspec.train builds full-vocab drafters without biases or norm_before_fc")
    p = init_params(drafter_param_spec(dc), key, num_layers=dc.num_layers)
    # Copies, not views: the trained tree is donated to the step, the target is not.
    if "lm_head" in p:
        p["lm_head"] = jnp.array(tparams["lm_head"], jnp.float32, copy=True)
    if "embed_tokens" in p:
        p["embed_tokens"] = jnp.array(tparams["embed_tokens"]["embedding"], jnp.float32, copy=True)
    return p


def save_drafter(params, d: dict, dc: DrafterConfig, folder: str, dtype: str = "float32"):
    specs = drafter_param_spec(dc)
    check_tree(params, specs)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**d, "torch_dtype": dtype}, f, indent=2)
    save_safetensors(tensors_from_specs(params, specs, jnp.dtype(dtype)), folder)


def target_signals(tparams, tc: ModelConfig, tokens, aux_layers: tuple[int, ...], dtype=jnp.float32):
    """The frozen target over tokens i32[B, T]: (aux f[B, T, n * H] at canonical
    ``aux_layers``, logits f32[B, T, V]); no gradient flows back."""
    h, aux = tgt.forward(tparams, tc, tokens, aux_layers, dtype)
    lg = tgt.logits(tparams, tc, h)
    B, T = tokens.shape
    return jax.lax.stop_gradient(aux.reshape(B, T, -1)), jax.lax.stop_gradient(lg)


def kl(target_logits, draft_logits):  # f32[..., V] x2 -> f32[...]: KL(p_target || q_draft)
    lp = jax.nn.log_softmax(target_logits.astype(jnp.float32), -1)
    lq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), -1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), -1)


def masked_mean(x, w):
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1e-6)


def agree(target_logits, draft_logits):  # -> f32[...]: 1 where the argmaxes agree
    return (jnp.argmax(target_logits, -1) == jnp.argmax(draft_logits, -1)).astype(jnp.float32)
