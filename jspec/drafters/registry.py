"""Drafter methods behind one protocol, keyed by method name: what the engine and the runner
need to know of a drafter without branching on its name.

A ``Drafter`` holds the Flax module (static under jit) and answers:
  propose(params, kv, inputs: ProposeInputs, *, num_tokens, with_probs)
      -> (drafts i32[B, >= K], probs f32[B, >= K, Vt] | None, KVCache)   (jspec/drafters/propose.py)
  lookahead(K)        slots it writes past the step's last verified token (the scheduler
                      reserves them before the step runs)
  create_cache(...)   its cache over the target's page ids: a KVCache, or the n-gram
                      method's TokenHistory
  reads_next_token    its KV at position p is built from the token at p + 1 (EAGLE-style): prefix
                      hashes must cover the token after a page, and the last hit page is recomputed
                      so its target hidden states exist
  check_num_tokens(K) a ValueError naming the limit when K cannot be drafted

Adding a method: a module, a propose function over ProposeInputs, and one registry entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn

from jspec.drafters.config import DrafterConfig
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.draft_model import DraftModel, draft_model_propose
from jspec.drafters.eagle3 import Eagle3Drafter, create_kv_cache
from jspec.drafters.ngram import NgramProposer, TokenHistory, ngram_propose
from jspec.drafters.propose import ProposeInputs, dflash_propose, eagle3_propose, peagle_propose
from jspec.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class Drafter:
    module: nn.Module | NgramProposer | DraftModel  # hashable: a static part of the jitted step
    propose_fn: Callable  # (module, params, kv, ProposeInputs, *, num_tokens, with_probs) -> ...
    reads_next_token: bool
    writes_ahead: str  # past the last token: "k" (K - 1 + 1 slots), "k+1", "block" (bonus + drafts), "none"
    label: str  # the method's name in messages ("DFlash")

    @property
    def cfg(self) -> DrafterConfig:
        return self.module.cfg

    def propose(self, params, kv: KVCache, inputs: ProposeInputs, *, num_tokens: int, with_probs: bool):
        return self.propose_fn(self.module, params, kv, inputs, num_tokens=num_tokens, with_probs=with_probs)

    def lookahead(self, K: int) -> int:
        # EAGLE3 / PEagle write K - 1 positions past the bonus pair (K counting the bonus
        # pair's own slot); a draft model K past it; DFlash writes its block_size positions
        # from the bonus on; the n-gram history only the verified pairs' own slots.
        return {"k": K, "k+1": K + 1, "block": self.cfg.block_size, "none": 0}[self.writes_ahead]

    def create_cache(self, num_pages: int, page_size: int, dtype, sharding=None):
        if self.cfg.method == "ngram":
            return TokenHistory.create(num_pages, page_size, sharding)
        return create_kv_cache(self.cfg, num_pages, page_size, dtype, sharding)

    def check_num_tokens(self, K: int):
        c = self.cfg
        if self.writes_ahead == "block" and K > c.block_size - 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={K} exceeds the {self.label} block's "
                f"{c.block_size - 1} drafts (block_size={c.block_size})"
            )


# method -> (module class, propose function, reads the next token, writes ahead, label)
REGISTRY: dict[str, tuple[type, Callable, bool, str, str]] = {
    "eagle3": (Eagle3Drafter, eagle3_propose, True, "k", "EAGLE3"),
    "peagle": (Eagle3Drafter, peagle_propose, True, "k", "PEagle"),  # PEagle lives in Eagle3Drafter (mask_hidden)
    "dflash": (DFlashDrafter, dflash_propose, False, "block", "DFlash"),
    # the history at p holds the token at p + 1, as EAGLE's KV is built from it
    "ngram": (NgramProposer, ngram_propose, True, "none", "n-gram"),
    # a whole LLM: its KV at p from the token at p, written up to K past the bonus pair
    "draft_model": (DraftModel, draft_model_propose, False, "k+1", "draft model"),
}


def make_drafter(cfg: DrafterConfig, *, dtype=None, plan=None) -> Drafter:
    """The Drafter for ``cfg.method``; an unknown method is a ValueError naming the known ones.
    ``plan``: the engine's KernelPlan; drafters run with ``plan.for_drafter()``, a draft
    model as a target does (``for_draft_model``)."""
    if cfg.method not in REGISTRY:
        raise ValueError(f"drafter method {cfg.method!r} is not supported (known: {sorted(REGISTRY)})")
    cls, fn, reads_next, ahead, label = REGISTRY[cfg.method]
    if plan is not None:
        plan = plan.for_draft_model(cfg.draft_model) if cfg.draft_model is not None else plan.for_drafter()
    kw = {k: v for k, v in (("dtype", dtype), ("plan", plan)) if v is not None}
    return Drafter(cls(cfg, **kw), fn, reads_next, ahead, label)
