"""Rewrite speculators-format drafters into the other layouts (tests, tools).

- ``speculators_eagle3_to_original``: -> ``LlamaForCausalLMEagle3`` (flat config,
  ``midlayer.*`` weights, no embeddings: the original layout shares the target's).
- ``speculators_dflash_to_zlab``: -> ``DFlashDraftModel`` with
  ``dflash_config.target_layer_ids = [c - 1 for c in aux_hidden_state_layer_ids]``
  (z-lab counts "output of layer t", one less than the canonical index).
"""

from __future__ import annotations

import json
import os

import numpy as np

from jspec.checkpoint.tensor_sources import open_tensor_source
from jspec.drafters.loader import read_drafter_config


def _read_all(folder: str) -> dict[str, np.ndarray]:
    with open_tensor_source(folder) as src:
        return {n: src.get_int(n) if n in ("d2t", "t2d") else np.asarray(src.get(n)) for n in src.names()}


def _write(folder: str, config: dict, tensors: dict[str, np.ndarray], as_bin: bool):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if as_bin:
        import torch

        torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()},
                   os.path.join(folder, "pytorch_model.bin"))
    else:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))


def speculators_eagle3_to_original(src: str, dst: str, *, as_bin: bool = False) -> str:
    d = read_drafter_config(src)
    if d.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{src}: not a speculators eagle3 drafter")
    tl = d["transformer_layer_config"]
    if tl.get("num_hidden_layers", 1) != 1:
        raise ValueError("the original EAGLE3 layout holds exactly one layer")
    cfg = dict(tl)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["draft_vocab_size"] = d["draft_vocab_size"]
    for k in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if d.get(k) is not None:
            cfg[k] = d[k]
    # Written explicitly: the layout's default for an absent key is a matter of convention.
    cfg["norm_before_residual"] = bool(d.get("norm_before_residual", False))
    tensors = {}
    for name, arr in _read_all(src).items():
        if name == "embed_tokens.weight":
            continue
        tensors[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = arr
    _write(dst, cfg, tensors, as_bin)
    return dst


def speculators_dflash_to_zlab(src: str, dst: str) -> str:
    d = read_drafter_config(src)
    if d.get("speculators_model_type") != "dflash":
        raise ValueError(f"{src}: not a speculators dflash drafter")
    cfg = dict(d["transformer_layer_config"])
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["block_size"] = d["block_size"]
    cfg["dflash_config"] = {
        "mask_token_id": d["mask_token_id"],
        "target_layer_ids": [int(c) - 1 for c in d["aux_hidden_state_layer_ids"]],
    }
    if d.get("draft_vocab_size") is not None:
        cfg["draft_vocab_size"] = d["draft_vocab_size"]
    _write(dst, cfg, _read_all(src), as_bin=False)
    return dst
