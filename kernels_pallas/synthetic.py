"""Synthetic acceptance: forced accept rates for benchmarking without trained drafters.

Pure Python (no jax): used by jspec.speculative_config at config-build time and by the
rejection sampler's tests.

- `synthetic_rates_from_length(L, K)`: mean acceptance length L (accepted drafts + bonus,
  in [1, K+1]) -> the minimum-variance schedule of K unconditional rates
  ([1]*f + [d - f] + [0]*(K-f-1))[:K] with d = L - 1, f = floor(d).
- `conditional_rates(r)`: unconditional r_i = P(first i+1 drafts accepted) ->
  conditional c_0 = r_0, c_i = r_i / r_{i-1} (0 where r_{i-1} == 0). The kernel accepts
  position i iff u_i < c_i, so P(num_accepted >= i+1) = prod(c_0..c_i) = r_i.
- `validate_synthetic(rates, length, K)`: the ValueErrors of vLLM's config, returns the
  conditional rates as a tuple of K floats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def synthetic_rates_from_length(length: float, num_speculative_tokens: int) -> tuple[float, ...]:
    """Mean acceptance length -> K unconditional rates (minimum-variance schedule)."""
    k = int(num_speculative_tokens)
    length = float(length)
    if not math.isfinite(length) or not 1.0 <= length <= k + 1:
        raise ValueError(
            f"synthetic_acceptance_length must be in [1, num_speculative_tokens + 1] = "
            f"[1, {k + 1}], got {length}"
        )
    d = length - 1.0
    f = math.floor(d)
    rates = ([1.0] * f + [d - f] + [0.0] * max(k - f - 1, 0))[:k]
    return tuple(float(r) for r in rates)


def conditional_rates(unconditional: Sequence[float]) -> tuple[float, ...]:
    """Unconditional rates r_i -> conditional c_i = r_i / r_{i-1} (c_0 = r_0; 0 if r_{i-1} == 0)."""
    out = []
    prev = 1.0
    for r in unconditional:
        r = float(r)
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return tuple(out)


def validate_unconditional(rates: Sequence[float], num_speculative_tokens: int) -> tuple[float, ...]:
    """Checks a list of K unconditional rates (length, range, non-increasing)."""
    try:
        rates = tuple(float(r) for r in rates)
    except (TypeError, ValueError) as e:
        raise ValueError(f"synthetic_acceptance_rates must be a list of numbers, got {rates!r}") from e
    k = int(num_speculative_tokens)
    if len(rates) != k:
        raise ValueError(
            f"synthetic_acceptance_rates must have num_speculative_tokens = {k} entries, "
            f"got {len(rates)}: {list(rates)}"
        )
    for i, r in enumerate(rates):
        if not (math.isfinite(r) and 0.0 <= r <= 1.0):
            raise ValueError(f"synthetic_acceptance_rates[{i}] = {r} is outside [0, 1]")
    for i in range(1, k):
        if rates[i] > rates[i - 1]:
            raise ValueError(
                f"synthetic_acceptance_rates must be non-increasing (entry i is P(first i+1 "
                f"drafts accepted)), but entry {i} = {rates[i]} > entry {i - 1} = {rates[i - 1]}"
            )
    return rates


def validate_synthetic(rates, length, num_speculative_tokens: int) -> tuple[float, ...]:
    """Exactly one of rates / length -> conditional rates (tuple of K floats)."""
    if (rates is None) == (length is None):
        raise ValueError(
            "rejection_sample_method='synthetic' needs exactly one of "
            "synthetic_acceptance_rates or synthetic_acceptance_length"
            + (" (both were given)" if rates is not None else " (neither was given)")
        )
    if rates is not None:
        unconditional = validate_unconditional(rates, num_speculative_tokens)
    else:
        unconditional = synthetic_rates_from_length(length, num_speculative_tokens)
    return conditional_rates(unconditional)
