"""Random weights from config.json alone: vLLM's ``load_format="dummy"``.

For benchmarks and smoke tests of shapes no checkpoint is at hand for (an 8B target and its
drafter on a GPU, no download): the folder needs only its config.json, and every tensor the
parameter spec names is drawn on the device, so the engine runs the same code as with real
weights. The values are what makes random weights usable for timing: matrices ~ N(0, 0.02)
(activations stay finite through the layers), norm weights ~ 1, integer maps (a reduced
draft vocabulary's d2t) zero, i.e. draft id i is target id i. A quantized leaf (FP8) is
drawn so, then quantized as its scheme holds it (vLLM's dummy weights under quantization="fp8");
MXFP4 experts are drawn packed (jspec.mxfp4.dummy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec import mxfp4
from jspec.checkpoint.param_spec import ParamSpec, set_path
from jspec.checkpoint.quantized import dummy_quant, scale_spec, weight_spec
from jspec.parallel.placement import Placement
from jspec.quantization import QuantWeight

LOAD_FORMATS = ("auto", "dummy")  # "auto": the folder's orbax copy, else its safetensors / .bin


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported (choose from {list(LOAD_FORMATS)})")
    return load_format


def dummy_params(specs: list[ParamSpec], dtype, seed: int = 0, sharding=None) -> dict:
    """A parameter tree for ``specs`` (a target's or a drafter's ParamSpecs)."""
    key = jax.random.PRNGKey(seed)
    tree: dict = {}
    for i, s in enumerate(specs):
        if s.integer:
            arr = jnp.zeros(s.shape, jnp.int32)
        elif s.packed:  # MXFP4 experts, kept packed
            arr = mxfp4.dummy(jax.random.fold_in(key, i), s.shape, dtype)
        else:
            k = jax.random.fold_in(key, i)
            is_norm = len(s.shape) == 1 and "norm" in "/".join(s.path)
            scale, base = (0.1, 1.0) if is_norm else (0.02, 0.0)
            arr = _normal(k, shape=tuple(s.shape), dtype=jnp.dtype(dtype), scale=scale, base=base)
        if s.quant is not None:
            q = dummy_quant(arr, s, dtype)
            arr = QuantWeight(_place(q.w, weight_spec(s), sharding), _place(q.scale, scale_spec(s), sharding),
                              q.block, q.dtype)
        elif s.packed:
            arr = mxfp4.Mxfp4Weight(_place(arr.blocks, s, sharding), _place(arr.scales, s, sharding), arr.dtype)
        else:
            arr = _place(arr, s, sharding)
        set_path(tree, s.path, arr)
    return jax.block_until_ready(tree)


def _place(arr, s: ParamSpec, sharding):
    if isinstance(sharding, Placement):  # tensor parallelism: the leaf's own split
        # The draw is the plain concatenated layout (q|k|v, gate|up), so every tp runs the
        # same model: greedy outputs compare across tensor-parallel sizes.
        return sharding.from_concatenated(sharding.place(arr, s), s)
    return arr if sharding is None else jax.device_put(arr, sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale", "base"))
def _normal(key, *, shape, dtype, scale, base):
    # One jitted draw per tensor: the float32 intermediate lives only inside it.
    return (base + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
