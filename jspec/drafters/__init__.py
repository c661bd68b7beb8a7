"""Drafters for speculative decoding: EAGLE3, PEagle, DFlash (configs, modules, loaders).

Public API:
  load_drafter(path, target_cfg, dtype) -> (DrafterConfig, params)
  Eagle3Drafter / PEagleDrafter / DFlashDrafter: Flax modules over the drafter's own KV cache
  create_kv_cache(cfg, num_pages, page_size, dtype)
  propose: eagle3_propose, peagle_propose, dflash_propose (jit-able, see propose.py)
"""

from jspec.drafters.config import DrafterConfig, drafter_config_from_hf
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.eagle3 import Eagle3Drafter, create_kv_cache, draft_probs_to_target, draft_to_target_ids
from jspec.drafters.loader import drafter_param_spec, load_drafter
from jspec.drafters.peagle import PEagleDrafter

__all__ = [
    "DrafterConfig", "drafter_config_from_hf", "DFlashDrafter", "Eagle3Drafter", "PEagleDrafter",
    "create_kv_cache", "draft_probs_to_target", "draft_to_target_ids", "drafter_param_spec", "load_drafter",
]
