"""``Method``: what one speculative method is, as its own module states it (``METHOD``) and
the registry (jspec/drafters/registry.py) lists it by name.

The engine, the runner, the loader and the config translation ask a method only through
these fields, never by its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


def any_num_tokens(cfg, K: int) -> None:
    """``Method.check_num_tokens`` of a method that drafts any K."""
    del cfg, K


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculative method. Hashable: a ``Drafter`` holding it is static under jit."""

    label: str  # its name in messages ("DFlash")
    module: type  # its drafter module, built as module(cfg, dtype=, plan=): hashable, static under jit
    # (module, params, cache, ProposeInputs, *, num_tokens, with_probs)
    #   -> (drafts i32[B, >= K], probs f32[B, >= K, Vt] | None, cache)   (jspec/drafters/propose.py)
    propose: Callable
    # (DrafterConfig, K) -> the slots it writes past the step's last verified token (the
    # scheduler reserves them before the step runs)
    lookahead: Callable
    # its cache at position p is built from the token at p + 1 (EAGLE-style): prefix hashes
    # must cover the token after a page, and the last hit page is recomputed so its target
    # hidden states exist
    reads_next_token: bool
    load: Callable  # (SpeculativeConfig, target ModelConfig, dtype, sharding, load_format) -> (DrafterConfig, params)
    create_cache: Callable  # (DrafterConfig, num_pages, page_size, dtype, sharding) -> its cache over the target's page ids
    needs_model: bool = True  # a checkpoint in speculative_config 'model' (else the family's drafter)
    check_num_tokens: Callable = any_num_tokens  # (DrafterConfig, K) -> None, or a ValueError naming the limit
    # The drafter checkpoint layout (jspec/drafters/config.py, loader.py), for a method whose
    # checkpoint is a drafter's config.json and tensors (None: it loads otherwise, ``load``).
    # from_hf(d, fmt, shape, target, tensor_names) -> config.MethodFields: its part of the
    # config.json's translation; a speculators config names it by speculators_model_type.
    from_hf: Callable | None = None
    param_spec: Callable | None = None  # (DrafterConfig, SpecList): its tensors after the shared fc / norm / d2t
    architectures: tuple[tuple[str, str], ...] = ()  # (HF architecture, source format FMT_*) naming it
