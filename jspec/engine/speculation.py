"""The engine's speculation, resolved from its ``EngineConfig``: the ``SpeculativeConfig``
(vLLM's dict; the method read off the checkpoint when not given, the embedded family's
drafter when no model is), the drafter loaded, its proposal length K, and what the engine
derives from them (the lookahead it reserves, how far it drafts). No speculative_config,
or one that is not enabled: ``PLAIN``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from jspec.speculative_config import SpeculativeConfig

logger = logging.getLogger("jspec.engine")


@dataclasses.dataclass(frozen=True)
class Speculation:
    spec: SpeculativeConfig | None  # resolved (num_speculative_tokens = K); None: plain decoding
    dcfg: object  # the drafter's DrafterConfig (None without one)
    dparams: object  # the drafter's parameter tree, as loaded (None without one)
    K: int  # drafts verified per row and step (0: plain decoding)
    lookahead: int  # positions past a step's own that the drafter writes (Drafter.lookahead)
    draft_max_len: float  # no draft at or past this position (math.inf: no limit of the drafter's)
    reads_next_token: bool  # EAGLE-style: the drafter's KV at p is built from token p + 1 (BlockManager)


PLAIN = Speculation(None, None, None, 0, 0, math.inf, False)


def spec_config(d, model: str) -> SpeculativeConfig | None:
    """``EngineConfig.speculative_config`` (a dict or a SpeculativeConfig) for the target at
    ``model``, its method and model filled in as vLLM fills them; None when not enabled."""
    if d is None:
        return None
    spec = d if isinstance(d, SpeculativeConfig) else SpeculativeConfig.from_dict(d)
    if spec.method is None and spec.model:  # vLLM infers the method from the checkpoint
        from jspec.drafters.loader import infer_method

        spec = dataclasses.replace(spec, method=infer_method(spec.model))
    if not spec.enabled:
        return None
    from jspec.drafters.registry import method_of

    if not spec.model and method_of(spec.method).needs_model:  # the embedded family's drafter (else a clear error)
        from jspec import family

        spec = dataclasses.replace(spec, model=family.drafter_for(model, spec.method))
    return spec


def load_speculation(c, mc, par, sharding=None, preloaded_drafter=None) -> Speculation:
    """The speculation of an engine of config ``c`` (EngineConfig) over the target ``mc``
    (ModelConfig): the drafter loaded (``preloaded_drafter=(DrafterConfig, params)`` instead
    when its method needs a checkpoint) and placed on ``par`` (parallel.EngineMesh), whose
    draft_tp it sets. ValueError when the checkpoint is another method's, or gives no K."""
    spec = spec_config(c.speculative_config, c.model)
    if spec is None:
        return PLAIN
    from jspec import parallel
    from jspec.drafters.registry import make_drafter, method_of

    par.draft_tp = parallel.resolve_draft_tp(spec.draft_tensor_parallel_size, par.tp)
    method = method_of(spec.method)
    if preloaded_drafter is not None and method.needs_model:
        dcfg, dparams = preloaded_drafter
    else:
        t = time.monotonic()
        dcfg, dparams = method.load(spec, mc, c.dtype, par.placement(sharding, True), c.load_format)
        logger.info("drafter loaded in %.1f s", time.monotonic() - t)
    if dcfg.method != spec.method:
        raise ValueError(
            f"speculative_config.method={spec.method!r} but the checkpoint at "
            f"{spec.model!r} is a {dcfg.method!r} drafter"
        )
    K = spec.num_speculative_tokens or dcfg.num_speculative_tokens
    if K is None:  # a draft model's config.json has no proposal length
        raise ValueError(f"speculative_config 'num_speculative_tokens' is required: the checkpoint at "
                         f"{spec.model!r} does not give one")
    drafter = make_drafter(dcfg)
    drafter.check_num_tokens(K)
    spec = spec.resolved(K)
    # no draft past the drafter's trained positions, nor speculative_config's max_model_len
    draft_max_len = min(dcfg.max_position_embeddings, spec.max_model_len or math.inf)
    return Speculation(spec, dcfg, dparams, K, drafter.lookahead(K), draft_max_len, drafter.reads_next_token)
