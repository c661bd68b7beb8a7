"""The speculative methods by name: one line each, the only list of method names.

Each method's module states what is specific to it in its ``METHOD`` (a ``Method``,
jspec/drafters/method.py): its drafter module, propose function, lookahead, load and cache,
and for a drafter checkpoint layout its config.json translation (``from_hf``) and parameter
spec. The engine, the runner, speculative_config, the config translation and the loader ask
a method only through the registry, never by its name.

Adding a method: a module defining its drafter module (built as ``module(cfg, dtype=,
plan=)``, hashable), a propose function over ``propose.ProposeInputs``, its ``lookahead``,
``load`` (and ``from_hf`` / ``param_spec`` if its checkpoint is a drafter config.json) and
``METHOD = Method(...)``; then one line in ``REGISTRY`` below (tests/drafters/
test_new_method.py adds a toy method so).

A ``Drafter`` (``make_drafter``) holds a method's module for one DrafterConfig and answers:
  propose(params, kv, inputs: ProposeInputs, *, num_tokens, with_probs)
      -> (drafts i32[B, >= K], probs f32[B, >= K, Vt] | None, its cache)
  lookahead(K)        slots it writes past the step's last verified token (the scheduler
                      reserves them before the step runs)
  reads_next_token    its KV at position p is built from the token at p + 1 (EAGLE-style): prefix
                      hashes must cover the token after a page, and the last hit page is recomputed
                      so its target hidden states exist
  create_cache(num_pages, page_size, dtype, sharding)   its cache over the target's page ids
  check_num_tokens(K) a ValueError naming the limit when K cannot be drafted
"""

from __future__ import annotations

import dataclasses

from jspec.drafters import dflash, draft_model, eagle3, ngram, peagle
from jspec.drafters.config import DrafterConfig
from jspec.drafters.method import Method
from jspec.drafters.propose import ProposeInputs

REGISTRY: dict[str, Method] = {
    "eagle3": eagle3.METHOD,
    "peagle": peagle.METHOD,
    "dflash": dflash.METHOD,
    "ngram": ngram.METHOD,
    "draft_model": draft_model.METHOD,
}


def method_names() -> tuple[str, ...]:
    """The known methods' names, in registry order."""
    return tuple(REGISTRY)


def method_of(name: str) -> Method:
    """The registry entry of ``name``; an unknown method is a ValueError naming the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"drafter method {name!r} is not supported (known: {sorted(REGISTRY)})")
    return REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Drafter:
    module: object  # the method's module for cfg; hashable: a static part of the jitted step
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

    def propose(self, params, kv, inputs: ProposeInputs, *, num_tokens: int, with_probs: bool):
        return self.method.propose(self.module, params, kv, inputs, num_tokens=num_tokens, with_probs=with_probs)

    def lookahead(self, K: int) -> int:
        return self.method.lookahead(self.cfg, K)

    def create_cache(self, num_pages: int, page_size: int, dtype, sharding=None):
        return self.method.create_cache(self.cfg, num_pages, page_size, dtype, sharding)

    def check_num_tokens(self, K: int):
        self.method.check_num_tokens(self.cfg, K)


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
