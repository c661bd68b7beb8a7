"""Synthetic acceptance: rate conversions, validation, and the kernel's measured rates."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.rejection_sampling import gpu_kernels, rejection_sample
from kernels_pallas.synthetic import (
    conditional_rates,
    synthetic_rates_from_length,
    validate_synthetic,
)


@pytest.mark.parametrize("length, k, want", [
    (2.6, 3, [1, 0.6, 0]), (1, 3, [0, 0, 0]), (4, 3, [1, 1, 1]), (2, 3, [1, 0, 0]),
    (3.5, 4, [1, 1, 0.5, 0]),
])
def test_length_to_rates(length, k, want):
    assert synthetic_rates_from_length(length, k) == pytest.approx(want)


def test_conditional_rates():
    assert conditional_rates([0.9, 0.5, 0.2]) == pytest.approx([0.9, 0.5 / 0.9, 0.2 / 0.5])
    assert conditional_rates([0.5, 0.0, 0.0]) == pytest.approx([0.5, 0.0, 0.0])


@pytest.mark.parametrize("rates, length, match", [
    (None, None, "neither"), ([0.5, 0.5], 1.5, "both"), ([0.5], None, "2 entries"),
    ([0.5, -0.1], None, r"outside \[0, 1\]"), ([0.3, 0.6], None, "non-increasing"),
    (None, 3.01, r"\[1, 3\]"), (None, 0.99, r"\[1, 3\]"),
])
def test_validation_errors(rates, length, match):
    with pytest.raises(ValueError, match=match):
        validate_synthetic(rates, length, 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_measured_rates_match(temperature):
    # 20,480 independent steps: P(num_accepted >= i+1) must match each unconditional rate
    # within 1e-2. The target disagrees with every draft (greedy) so only the forced
    # decisions can accept. The decisions are the shared jnp epilogue's: the reference
    # measures them, and the kernel (interpret mode) gives the same tokens on 512 rows.
    b, k, v = 20480, 3, 16
    unconditional = [0.9, 0.6, 0.25]
    logits = jnp.zeros((b, k + 1, v), jnp.float32).at[:, :, 0].set(5.0)
    drafts = jnp.full((b, k), 7, jnp.int32)
    args = (logits, drafts, jnp.full((b,), k, jnp.int32), None, jnp.full((b,), temperature, jnp.float32),
            jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), jnp.arange(b, dtype=jnp.uint32),
            jnp.full((b,), 100, jnp.int32))
    kw = dict(method="synthetic", synthetic_rates=conditional_rates(unconditional))
    out, n_emit = rejection_sample(*args, **kw)
    accepted = np.asarray(n_emit) - 1
    for i, r in enumerate(unconditional):
        assert abs(np.mean(accepted >= i + 1) - r) < 1e-2, (i, np.mean(accepted >= i + 1), r)
    out = np.asarray(out)
    rows = np.arange(b)
    assert np.all(out[rows[:, None], np.arange(k + 1)[None]][np.arange(k + 1)[None] < accepted[:, None]] == 7)
    if temperature == 0.0:
        assert np.all(out[rows, accepted] == 0)  # rejection/bonus emits the target argmax
    few = tuple(a if a is None else a[:512] for a in args)
    k_out, k_emit = rejection_sample(*few, kernels=gpu_kernels(interpret=True), **kw)
    np.testing.assert_array_equal(np.asarray(k_emit), np.asarray(n_emit)[:512])
    np.testing.assert_array_equal(np.asarray(k_out), out[:512])
