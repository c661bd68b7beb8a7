"""MXFP4 weights kept packed (jspec/mxfp4.py): the device's dequantization against
transformers' own, the test writer's quantizer, and random packed weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import mxfp4
from jspec.checkpoint.gpt_oss_layout import mxfp4_quantize


def _packed(shape, seed=0):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, shape[:-1] + (shape[-1] // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 135, shape[:-1] + (shape[-1] // 32,), dtype=np.uint8)
    return blocks, scales


def f32(blocks, scales):
    return np.asarray(mxfp4.Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales)).dequantize())


def test_dequantize_equals_transformers():
    blocks, scales = _packed((3, 8, 64))
    got = np.asarray(mxfp4.Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales)).dequantize())
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(got, ref.transpose(1, 2).numpy())  # transformers returns [E, in, out]


def test_bfloat16_holds_every_value_exactly_and_take_keeps_the_packing():
    blocks, scales = _packed((4, 8, 64), seed=1)
    w = mxfp4.Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales), "bfloat16")
    assert w.shape == (4, 8, 64) and w.ndim == 3
    d = w.dequantize()
    assert d.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(d, np.float32), f32(blocks, scales))
    t = w.take(jnp.array([2, 0]))
    assert t.blocks.dtype == jnp.uint8 and t.shape == (2, 8, 64)
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(d)[[2, 0]])


def test_quantize_round_trips_values_on_the_grid():
    blocks, scales = _packed((2, 4, 96), seed=2)
    values = f32(blocks, scales)
    b2, s2 = mxfp4_quantize(values)
    np.testing.assert_array_equal(f32(b2, s2), values)


def test_dummy_weights_have_the_asked_spread_and_the_declared_shapes():
    w = mxfp4.dummy(jax.random.PRNGKey(0), (2, 64, 256), "bfloat16", scale=0.02)
    d = np.asarray(w.dequantize(), np.float32)
    assert d.shape == (2, 64, 256) and 0.01 < d.std() < 0.04
    decl = mxfp4.declared(None, (2, 64, 256), jnp.bfloat16)
    assert [a.shape for a in jax.tree.leaves(decl)] == [a.shape for a in jax.tree.leaves(w)]
