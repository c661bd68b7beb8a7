"""Drafters for speculative decoding: one module per method (eagle3, peagle, dflash, ngram,
draft_model), each owning its config translation, parameter spec, proposal and registry
entry; registry.py lists them by name.

Public API:
  load_drafter(path, target_cfg, dtype) -> (DrafterConfig, params)
  Eagle3Drafter / PEagleDrafter / DFlashDrafter: Flax modules over the drafter's own KV cache
  create_kv_cache(cfg, num_pages, page_size, dtype)
  propose: eagle3_propose, peagle_propose, dflash_propose (jit-able, over propose.ProposeInputs)
"""

from jspec.drafters.config import DrafterConfig, drafter_config_from_hf
from jspec.drafters.dflash import DFlashDrafter, dflash_propose
from jspec.drafters.eagle3 import Eagle3Drafter, draft_probs_to_target, draft_to_target_ids, eagle3_propose
from jspec.drafters.loader import drafter_param_spec, load_drafter
from jspec.drafters.peagle import PEagleDrafter, peagle_propose
from jspec.drafters.propose import create_kv_cache

__all__ = [
    "DrafterConfig", "drafter_config_from_hf", "DFlashDrafter", "Eagle3Drafter", "PEagleDrafter",
    "create_kv_cache", "draft_probs_to_target", "draft_to_target_ids", "drafter_param_spec", "load_drafter",
    "eagle3_propose", "peagle_propose", "dflash_propose",
]
