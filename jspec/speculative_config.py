"""SpeculativeConfig: the `speculative_config` dict of vLLM, validated when built.

Keys (vLLM names and meanings):
- method: a name of jspec/drafters/registry.py ("eagle3" | "peagle" | "dflash" | "ngram" |
  "draft_model") or None (no speculation). "ngram" (vLLM's prompt lookup; its "[ngram]"
  and "ngram_gpu" are the same here) drafts the tokens that followed the earliest earlier
  occurrence of the sequence's last n tokens, with no model (jspec/drafters/ngram.py).
- model: drafter checkpoint path / HF id (none with "ngram"; with "draft_model" an ordinary
  Llama / Qwen3 folder of the target's vocabulary, jspec/drafters/draft_model.py). Given
  without a method, the engine reads the method off the checkpoint, as vLLM does: a drafter
  layout's, else "draft_model".
- num_speculative_tokens: K >= 1; None means "take it from the drafter checkpoint", then
  call `resolved(K)` to fill it in and validate what depends on K ("ngram" has none: K is
  required).
- prompt_lookup_min / prompt_lookup_max: "ngram" only, the n-gram lengths matched (vLLM's
  defaults: both 5 when neither is given, else the one given for both).
- rejection_sample_method: "standard" (Leviathan rejection sampling, lossless) or
  "synthetic" (accept decisions forced at chosen rates, for benchmarking).
- synthetic_acceptance_rates: K unconditional rates, entry i = P(first i+1 drafts
  accepted), in [0, 1], non-increasing. Only with "synthetic".
- synthetic_acceptance_length: mean accepted tokens per step including the bonus, in
  [1, K+1]; turned into the minimum-variance schedule. Only with "synthetic"; exactly one
  of the two synthetic keys must be set.
- draft_sample_method: "greedy" (argmax drafts; the verifier treats q as one-hot) or
  "probabilistic" (drafts sampled from q, which the drafter passes to the verifier).
- draft_tensor_parallel_size: None (the target's tensor_parallel_size), 1 (the drafter
  replicated on every device of the target's mesh) or the target's (sharded as the target).
- max_model_len: no draft past this position (vLLM's draft max_model_len), besides the
  drafter's own max_position_embeddings and the target's max_model_len.
- disable_by_batch_size: at this many running rows or more a decode step runs without the
  drafter (vLLM's key; int >= 2, or None).
- dynamic (jspec's, default False): each decode step verifies as many drafts as pays, from
  the measured step times and each request's measured acceptance, 0 included
  (jspec/engine/dynamic_spec.py). Off by default while its cost model still misjudges
  some batch sizes (docs/benchmarks.md "Dynamic speculation"), and for the decode
  programs it adds to warmup.
vLLM's other keys are taken as jspec/vllm_args.py takes its engine arguments: accepted with
one log line saying why they change nothing (NO_EFFECT), or only at vLLM's default
(DEFAULT_ONLY). Unknown keys raise ValueError naming the key; a method jspec does not have
(vLLM's "suffix", "medusa", "mtp", ...) is named before its own keys are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jspec import vllm_args
from kernels_pallas.synthetic import (
    conditional_rates,
    synthetic_rates_from_length,
    validate_synthetic,
    validate_unconditional,
)

# vLLM's other names of the n-gram method: its CPU proposer's old spelling and its GPU one
NGRAM_ALIASES = ("[ngram]", "ngram_gpu")
# vLLM's keys with nothing to set here, and why (logged when given)
NO_EFFECT = {
    "disable_padded_drafter_batch": "the drafter runs inside the verification step's one program, over its rows",
    "enforce_eager": "jspec has no eager mode: the drafter is compiled with the step",
    "disable_log_stats": "the speculative counters are always kept (LLM.get_metrics, the server's /metrics)",
}
# vLLM's keys taken at their default only: (the default, why no other value)
DEFAULT_ONLY = {
    "quantization": (None, "the drafter's weights are loaded unquantized"),
    "revision": (None, "jspec loads local folders; no model hub is reached"),
    "code_revision": (None, "jspec runs no code from a checkpoint"),
    "speculative_token_tree": (None, "jspec drafts one chain of tokens, not a tree"),
}
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")

__all__ = [
    "SpeculativeConfig",
    "conditional_rates",
    "synthetic_rates_from_length",
]


def _check_method(method) -> None:
    if method is None or method in NGRAM_ALIASES:
        return
    # The registry imports every method's module (flax, the checkpoint loaders): imported
    # when a method is named, not with this light module.
    from jspec.drafters.registry import method_names

    names = method_names()
    if method not in names:
        raise ValueError(f"speculative_config 'method' must be one of {names} or None, got {method!r}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str = "greedy"
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    dynamic: bool = False

    def __post_init__(self):
        self._check_ngram()
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 2):
            raise ValueError(f"speculative_config 'disable_by_batch_size' must be an int >= 2 or None, got {b!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"speculative_config 'dynamic' must be true or false, got {self.dynamic!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"speculative_config 'max_model_len' must be an int >= 1, got {m!r}")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (isinstance(dtp, bool) or not isinstance(dtp, int) or dtp < 1):
            raise ValueError(f"speculative_config 'draft_tensor_parallel_size' must be an int >= 1, got {dtp!r}")
        _check_method(self.method)
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config 'model' must be a string, got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's folder")
        k = self.num_speculative_tokens
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"speculative_config 'num_speculative_tokens' must be an int >= 1, got {k!r}")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config 'rejection_sample_method' must be one of "
                f"{REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config 'draft_sample_method' must be one of "
                f"{DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}")
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if rates is not None:
            if isinstance(rates, (str, bytes)) or not hasattr(rates, "__iter__"):
                raise ValueError(f"'synthetic_acceptance_rates' must be a list of numbers, got {rates!r}")
            # Stored as a tuple so the config stays hashable (static under jit).
            object.__setattr__(self, "synthetic_acceptance_rates", tuple(float(r) for r in rates))
            rates = self.synthetic_acceptance_rates
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not math.isfinite(length):
                raise ValueError(f"'synthetic_acceptance_length' must be a number, got {length!r}")
            object.__setattr__(self, "synthetic_acceptance_length", float(length))
            length = self.synthetic_acceptance_length
        if self.rejection_sample_method != "synthetic":
            for key, val in (("synthetic_acceptance_rates", rates), ("synthetic_acceptance_length", length)):
                if val is not None:
                    raise ValueError(
                        f"'{key}' is only valid with rejection_sample_method='synthetic' "
                        f"(got rejection_sample_method={self.rejection_sample_method!r})")
            return
        if k is not None:
            validate_synthetic(rates, length, k)
            return
        # K unknown until the drafter checkpoint is read: check what does not depend on it.
        if (rates is None) == (length is None):
            validate_synthetic(rates, length, 0)  # raises the both/neither error
        if rates is not None:
            validate_unconditional(rates, len(rates))
        elif length < 1.0:
            raise ValueError(f"synthetic_acceptance_length must be >= 1, got {length}")

    def _check_ngram(self):
        """vLLM's n-gram spellings as "ngram", its prompt_lookup defaults, and their checks."""
        if self.method is None and self.model in ("ngram", "[ngram]"):  # vLLM's older way to ask for it
            object.__setattr__(self, "method", "ngram")
        if self.method in NGRAM_ALIASES:
            object.__setattr__(self, "method", "ngram")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            for key, val in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if val is not None:
                    raise ValueError(f"speculative_config {key!r} is only valid with method 'ngram' "
                                     f"(got method={self.method!r})")
            return
        if self.model in ("ngram", "[ngram]"):
            object.__setattr__(self, "model", None)
        if self.model is not None:
            raise ValueError(f"speculative_config 'model' has no use with method 'ngram' (it drafts from the "
                             f"sequence's own tokens), got {self.model!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config 'num_speculative_tokens' is required with method 'ngram' "
                             "(there is no drafter checkpoint to take it from)")
        for key, val in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"speculative_config {key!r} must be an int >= 1, got {val!r}")
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative_config 'prompt_lookup_min'={lo} must be <= 'prompt_lookup_max'={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SpeculativeConfig:
        """Builds from vLLM's `speculative_config` dict; unknown keys raise ValueError."""
        d = dict(d or {})
        _check_method(d.get("method"))  # before its keys: vLLM's methods have keys of their own
        for key in [k for k in d if k in NO_EFFECT]:
            vllm_args.note_no_effect(key, d.pop(key), NO_EFFECT[key], where="speculative_config ")
        for key in [k for k in d if k in DEFAULT_ONLY]:
            default, why = DEFAULT_ONLY[key]
            vllm_args.check_default(key, d.pop(key), default, why, where="speculative_config ")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key {unknown[0]!r}"
                + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
                + f"; known keys: {sorted(names)}")
        return cls(**d)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def resolved(self, num_speculative_tokens: int) -> SpeculativeConfig:
        """A copy with K filled in (if it was None) and the synthetic part validated."""
        if self.num_speculative_tokens is not None and self.num_speculative_tokens != num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} in the config differs "
                f"from {num_speculative_tokens} given to resolved()")
        return dataclasses.replace(self, num_speculative_tokens=int(num_speculative_tokens))

    @property
    def synthetic_conditional_rates(self) -> tuple[float, ...]:
        """The K conditional rates the synthetic kernel uses (c_i = r_i / r_{i-1})."""
        if self.rejection_sample_method != "synthetic":
            raise ValueError("synthetic_conditional_rates needs rejection_sample_method='synthetic'")
        if self.num_speculative_tokens is None:
            raise ValueError("num_speculative_tokens is not known yet: call resolved(K) first")
        return validate_synthetic(self.synthetic_acceptance_rates, self.synthetic_acceptance_length,
                                  self.num_speculative_tokens)

    @property
    def synthetic_unconditional_rates(self) -> tuple[float, ...]:
        """The K unconditional rates (given, or derived from the mean length)."""
        if self.rejection_sample_method != "synthetic" or self.num_speculative_tokens is None:
            raise ValueError("needs rejection_sample_method='synthetic' and a known num_speculative_tokens")
        if self.synthetic_acceptance_rates is not None:
            return self.synthetic_acceptance_rates
        return synthetic_rates_from_length(self.synthetic_acceptance_length, self.num_speculative_tokens)
