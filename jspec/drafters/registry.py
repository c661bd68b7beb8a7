"""Speculative methods behind one protocol, keyed by method name: what the engine and the
runner need to know of a method without branching on its name.

A ``Method`` (the registry's entry) says how a method loads and what its drafter does:
  load(spec, target_cfg, dtype, sharding, load_format) -> (DrafterConfig, params)
                      its checkpoint (``spec.model``), or none (``needs_model`` False: n-gram)
  create_cache(cfg, num_pages, page_size, dtype, sharding)
                      its cache over the target's page ids: a KVCache, or the n-gram
                      method's TokenHistory

A ``Drafter`` holds the Flax module (static under jit) and answers:
  propose(params, kv, inputs: ProposeInputs, *, num_tokens, with_probs)
      -> (drafts i32[B, >= K], probs f32[B, >= K, Vt] | None, KVCache)   (jspec/drafters/propose.py)
  lookahead(K)        slots it writes past the step's last verified token (the scheduler
                      reserves them before the step runs)
  reads_next_token    its KV at position p is built from the token at p + 1 (EAGLE-style): prefix
                      hashes must cover the token after a page, and the last hit page is recomputed
                      so its target hidden states exist
  check_num_tokens(K) a ValueError naming the limit when K cannot be drafted

Adding a method: a module, a propose function over ProposeInputs, a load function, and one
registry entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn

from jspec.drafters.config import DrafterConfig
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.draft_model import DraftModel, draft_model_propose, load_draft_model
from jspec.drafters.eagle3 import Eagle3Drafter, create_kv_cache
from jspec.drafters.loader import load_drafter
from jspec.drafters.ngram import NgramProposer, TokenHistory, ngram_config, ngram_propose
from jspec.drafters.propose import ProposeInputs, dflash_propose, eagle3_propose, peagle_propose
from jspec.kv_cache import KVCache


def _load_drafter(spec, target, dtype, sharding, load_format):
    return load_drafter(spec.model, target, dtype, sharding, load_format=load_format)


def _load_draft_model(spec, target, dtype, sharding, load_format):
    return load_draft_model(spec.model, target, dtype, sharding, load_format=load_format)


def _load_ngram(spec, target, dtype, sharding, load_format):
    del dtype, sharding, load_format  # no weights: drafts from the sequence's own tokens
    return ngram_config(target, spec.prompt_lookup_min, spec.prompt_lookup_max), {}


def _ngram_cache(cfg, num_pages, page_size, dtype, sharding=None):
    del cfg, dtype
    return TokenHistory.create(num_pages, page_size, sharding)


@dataclasses.dataclass(frozen=True)
class Method:
    """A registry entry: one speculative method."""

    module: type  # the drafter's module class, built as module(cfg, dtype=, plan=)
    propose: Callable  # (module, params, kv, ProposeInputs, *, num_tokens, with_probs) -> ...
    reads_next_token: bool
    writes_ahead: str  # past the last token: "k" (K - 1 + 1 slots), "k+1", "block" (bonus + drafts), "none"
    label: str  # the method's name in messages ("DFlash")
    load: Callable = _load_drafter  # (spec, target_cfg, dtype, sharding, load_format) -> (DrafterConfig, params)
    create_cache: Callable = create_kv_cache  # (cfg, num_pages, page_size, dtype, sharding) -> its cache
    needs_model: bool = True  # a checkpoint in speculative_config 'model' (else the family's drafter)


REGISTRY: dict[str, Method] = {
    "eagle3": Method(Eagle3Drafter, eagle3_propose, True, "k", "EAGLE3"),
    "peagle": Method(Eagle3Drafter, peagle_propose, True, "k", "PEagle"),  # PEagle lives in Eagle3Drafter (mask_hidden)
    "dflash": Method(DFlashDrafter, dflash_propose, False, "block", "DFlash"),
    # the history at p holds the token at p + 1, as EAGLE's KV is built from it
    "ngram": Method(NgramProposer, ngram_propose, True, "none", "n-gram", load=_load_ngram,
                    create_cache=_ngram_cache, needs_model=False),
    # a whole LLM: its KV at p from the token at p, written up to K past the bonus pair
    "draft_model": Method(DraftModel, draft_model_propose, False, "k+1", "draft model", load=_load_draft_model),
}


def method_of(name: str) -> Method:
    """The registry entry of ``name``; an unknown method is a ValueError naming the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"drafter method {name!r} is not supported (known: {sorted(REGISTRY)})")
    return REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Drafter:
    module: nn.Module | NgramProposer | DraftModel  # hashable: a static part of the jitted step
    method: Method

    @property
    def cfg(self) -> DrafterConfig:
        return self.module.cfg

    @property
    def reads_next_token(self) -> bool:
        return self.method.reads_next_token

    @property
    def label(self) -> str:
        return self.method.label

    def propose(self, params, kv: KVCache, inputs: ProposeInputs, *, num_tokens: int, with_probs: bool):
        return self.method.propose(self.module, params, kv, inputs, num_tokens=num_tokens, with_probs=with_probs)

    def lookahead(self, K: int) -> int:
        # EAGLE3 / PEagle write K - 1 positions past the bonus pair (K counting the bonus
        # pair's own slot); a draft model K past it; DFlash writes its block_size positions
        # from the bonus on; the n-gram history only the verified pairs' own slots.
        return {"k": K, "k+1": K + 1, "block": self.cfg.block_size, "none": 0}[self.method.writes_ahead]

    def create_cache(self, num_pages: int, page_size: int, dtype, sharding=None):
        return self.method.create_cache(self.cfg, num_pages, page_size, dtype, sharding)

    def check_num_tokens(self, K: int):
        c = self.cfg
        if self.method.writes_ahead == "block" and K > c.block_size - 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={K} exceeds the {self.label} block's "
                f"{c.block_size - 1} drafts (block_size={c.block_size})"
            )


def make_drafter(cfg: DrafterConfig, *, dtype=None, plan=None) -> Drafter:
    """The Drafter for ``cfg.method``; an unknown method is a ValueError naming the known ones.
    ``plan``: the engine's KernelPlan; every drafter runs the target's kernels at its own
    shapes (``for_draft_model``: a draft model's config, else the drafter's layer config):
    its layers are target-style layers, its first pass and DFlash's block verification-width
    forwards (fused_linear_rows at batch 1), EAGLE3's later steps one-row forwards."""
    m = method_of(cfg.method)
    if plan is not None:
        plan = plan.for_draft_model(cfg.draft_model if cfg.draft_model is not None else cfg.layer_config())
    kw = {k: v for k, v in (("dtype", dtype), ("plan", plan)) if v is not None}
    return Drafter(m.module(cfg, **kw), m)
