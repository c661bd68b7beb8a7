"""FP8 leaves of the parameter tree (jspec/quantization.py): their scales in the leaf's
ParamSpec (``QuantSpec``), checked with the other tensors and read as a ``QuantWeight``.

A quantized leaf is read as two leaves of the ordinary kind, so every way a leaf is read
(one device, or split over a mesh by jspec/parallel/placement.py) reads them alike:
  - the weight: the leaf's sources as float8_e4m3fn (``weight_spec``);
  - the scale (``scale_spec``): each source's scale, a per-tensor one expanded to its rows
    (so a fused q|k|v or gate|up leaf holds one scale per output row), concatenated on axis
    0 as the weights are: [out, 1] per channel, a block scale's block rows
    [sum ceil(out_i / b0), ceil(in / b1)], reshaped as the leaf is ([E, ...] for experts).
A part of a fused leaf with a block scale must have whole blocks of rows (else its blocks
would straddle the next part's). Under tensor parallelism a column-parallel leaf's scale is
split by rows with it; a row-parallel leaf's per-channel scale is replicated and its block
scale split by block columns.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.quantization import FP8, QuantConfig, QuantWeight, quantize_fp8


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A quantized leaf's scales: one scale tensor per weight source (none "online")."""

    scheme: str  # QuantConfig.scheme: "channel" | "tensor" | "block" | "online" (made at load)
    scales: tuple[str, ...]  # the scale tensors, in the order of the leaf's sources
    scale_shapes: tuple[tuple[int, ...], ...]  # their shapes in the checkpoint ((1,) per tensor; () is taken too)
    block: tuple[int, int] | None = None
    # Tensors the format holds that a weight-only path has no use for (static activations'
    # input_scale): expected, never read.
    unread: tuple[str, ...] = ()


def quant_spec(qc: QuantConfig | None, modules, weight_shapes, stacked: int = 1) -> QuantSpec | None:
    """The QuantSpec of a leaf made of the projections ``modules`` (HF names) of shapes
    ``weight_shapes`` [out, in], or None when unquantized. ``stacked``: experts stacked on the
    leaf's axis 0 (each a run of len(modules) / stacked sources)."""
    if qc is None:
        return None
    which = [qc.quantized(m) for m in modules]
    if not any(which):
        return None
    if not all(which):
        on, off = (next(m for m, q in zip(modules, which) if q is want) for want in (True, False))
        raise CheckpointError(f"config.json's quantization_config quantizes {on!r} but not {off!r}, which jspec "
                              f"holds in one fused weight")
    if qc.scheme == "online":
        return QuantSpec("online", (), ())
    names = tuple(f"{m}.{qc.scale_suffix}" for m in modules)
    unread = tuple(f"{m}.input_scale" for m in modules) if qc.input_scale else ()
    if qc.scheme == "channel":
        return QuantSpec("channel", names, tuple((s[0], 1) for s in weight_shapes), None, unread)
    if qc.scheme == "tensor":
        return QuantSpec("tensor", names, tuple((1,) for _ in weight_shapes), None, unread)
    b0, b1 = qc.block
    run = len(modules) // stacked
    for i, (m, s) in enumerate(zip(modules, weight_shapes)):
        if (i + 1) % run and s[0] % b0:  # not the last part of its leaf (or expert): whole blocks of rows
            raise CheckpointError(f"tensor {m + '.weight'!r} has {s[0]} rows, not a multiple of the quantization "
                                  f"block's {b0}: jspec fuses it with the next projection, and its blocks would "
                                  f"straddle both")
    return QuantSpec("block", names, tuple((-(-s[0] // b0), -(-s[1] // b1)) for s in weight_shapes), (b0, b1),
                     unread)


def scale_shape(spec) -> tuple[int, ...]:
    """The scale's shape in the leaf (HF layout) of ParamSpec ``spec``."""
    q, lead = spec.quant, tuple(spec.shape[:-2])
    if q.scheme != "block":
        return tuple(spec.shape[:-1]) + (1,)
    rows = sum(s[0] for s in q.scale_shapes) // math.prod(lead)
    return lead + (rows, q.scale_shapes[0][1])


def weight_spec(spec):
    """The weight of a quantized leaf as a ParamSpec of its own (read as float8_e4m3fn)."""
    return dataclasses.replace(spec, quant=None)


def scale_spec(spec):
    """The scale of a quantized leaf as a ParamSpec: sources its scale tensors (the weights'
    names "online", never read), shapes as the leaf holds them (per-tensor: per row)."""
    q = spec.quant
    if q.scheme == "block":
        shapes, split = q.scale_shapes, spec.split  # split by block rows (column parallel) or columns (row parallel)
    else:
        shapes, split = tuple((s[0], 1) for s in spec.source_shapes), (0 if spec.split == 0 else None)
    names = q.scales or spec.sources
    return dataclasses.replace(spec, shape=scale_shape(spec), sources=names, source_shapes=shapes, split=split,
                               quant=None, vocab=False)


def check_quant(src, spec, folder: str):
    """The weights of ``spec`` stored as float8_e4m3fn where it is quantized from the file
    (and not where it is not, or is quantized at load); its scales present with their
    shapes, as floats. CheckpointError naming the tensor otherwise."""
    q = spec.quant
    fp8 = q is not None and q.scheme != "online"
    for name in spec.sources:
        if src.is_fp8(name) != fp8:
            why = ("expected float8_e4m3fn: config.json's quantization_config quantizes it" if fp8 else
                   "jspec reads it unquantized (no quantization_config quantizes it, and an embedding, lm_head "
                   "or router never is)")
            raise CheckpointError(f"tensor {name!r} in {folder!r} is stored as {src.dtype(name)}: {why}")
    if not fp8:
        return
    for name, want in zip(q.scales, q.scale_shapes):
        if name not in src:
            raise CheckpointError(f"checkpoint {folder!r} is missing tensor {name!r} (the scale of a quantized "
                                  f"weight)")
        got = tuple(src.shape(name))
        if got != want and not (q.scheme == "tensor" and got == ()):
            raise CheckpointError(f"tensor {name!r} in {folder!r} has shape {list(got)}, expected {list(want)} "
                                  f"({q.scheme} scale of its weight)")
        if not src.is_float(name) or src.is_fp8(name):
            raise CheckpointError(f"tensor {name!r} in {folder!r} is stored as {src.dtype(name)}: a scale must be "
                                  f"a 16- or 32-bit float")


class WeightReads:
    """A tensor source whose tensors are read as float8_e4m3fn (the quantized weights)."""

    def __init__(self, src):
        self.src = src

    def get(self, name):
        return self.src.get_fp8(name)

    def get_part(self, name, index):
        return self.src.get_fp8(name)[index]


class ScaleReads:
    """A tensor source whose tensors are a quantized leaf's scales, as float32, a per-tensor
    one expanded to its weight's rows [out, 1]."""

    def __init__(self, src, spec):
        self.src, self.q = src, spec.quant
        self.rows = {n: s[0] for n, s in zip(spec.quant.scales, spec.source_shapes)}

    def get(self, name):
        s = np.asarray(self.src.get(name), np.float32)
        return np.full((self.rows[name], 1), s.reshape(()), np.float32) if self.q.scheme == "tensor" else s

    def get_part(self, name, index):
        return self.get(name)[index]


def read_quant(src, spec, dtype, read, place) -> QuantWeight:
    """The QuantWeight of quantized ``spec``: ``read(src, spec, dtype)`` (a plain leaf's read,
    on one device or split over the mesh) of its weight and of its scale. "online": the
    unquantized weight read (float32) and quantized per output channel, each part then put
    where ``place(array, spec)`` puts a leaf of that spec."""
    q, name = spec.quant, jnp.dtype(dtype).name
    if q.scheme == "online":
        qw = _quantize(read(src, weight_spec(spec), jnp.float32), None, name)
        return QuantWeight(place(qw.w, weight_spec(spec)), place(qw.scale, scale_spec(spec)), None, name)
    w = read(WeightReads(src), weight_spec(spec), FP8)
    s = read(ScaleReads(src, spec), scale_spec(spec), jnp.float32)
    return QuantWeight(w, s, q.block, name)


def dummy_quant(arr, spec, dtype) -> QuantWeight:
    """Random weights ``arr`` (the leaf drawn unquantized) quantized as the leaf's scheme
    would hold them: per block for a block scheme, else per output channel."""
    return _quantize(arr, spec.quant.block, jnp.dtype(dtype).name)


_quantize = jax.jit(quantize_fp8, static_argnums=(1, 2))

