"""The one parameter spec and loader of targets and drafters.

A spec function (``target_param_spec`` in target.py, ``drafter_param_spec`` in
jspec/drafters/loader.py) lists one ``ParamSpec`` per leaf of our parameter tree: its path,
its shape and the checkpoint tensors it is made of. From that list alone
``check_specs`` checks every tensor name and shape before any tensor is read (a bad
checkpoint fails naming the tensor, and both shapes), ``load_params`` streams the tensors
into the tree, dummy.py draws random weights and target.py's orbax restore builds its
target tree. A quantized leaf (``ParamSpec.quant``: FP8 weights, jspec/checkpoint/quantized.py)
is checked and read with its scales, as a ``jspec.quantization.QuantWeight``; an MXFP4 one
(gpt-oss's experts, ``ParamSpec.packed``) as a ``jspec.mxfp4.Mxfp4Weight``.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.quantized import QuantSpec, check_quant, read_quant
from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.mxfp4 import Mxfp4Weight

logger = logging.getLogger("jspec.checkpoint")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One leaf: its ``sources`` concatenated on axis 0, then reshaped to ``shape``."""

    path: tuple[str, ...]  # our tree path
    shape: tuple[int, ...]  # our shape
    sources: tuple[str, ...]  # checkpoint tensor names
    source_shapes: tuple[tuple[int, ...], ...]  # their shapes in the checkpoint
    integer: bool = False  # kept as int32 (d2t), never cast to the float dtype
    # Tensor parallelism (jspec/parallel): the axis of ``shape`` (HF [out, in] layout) split
    # over the mesh's "tp" axis, Megatron-style: 0 column-parallel (output rows, a
    # vocabulary), 1 row-parallel (input columns); None replicated. A leaf of several
    # sources split on axis 0 holds, on each device, that device's slice of every source in
    # turn ("tp-interleaved": [q_i | k_i | v_i], [gate_i | up_i]; ops.split_fused reads it).
    split: int | None = None
    # Axis 0 is a vocabulary (an embedding, an lm_head): on the mesh it is padded with zero
    # rows to a multiple of tp (parallel.padded_vocab, Placement.shape), so any size splits.
    vocab: bool = False
    # FP8 weights (a float8_e4m3fn weight and its scales, read as a QuantWeight): the scales'
    # tensors and scheme (jspec/checkpoint/quantized.py); None: an ordinary leaf.
    quant: QuantSpec | None = None
    # A rearrangement of the sources into our layout (gpt_oss_layout.LAYOUTS' key: gpt-oss's
    # interleaved and transposed experts, MXFP4 blocks and scales); None: concatenated as they are.
    layout: str | None = None

    @property
    def packed(self) -> bool:
        """Its sources are MXFP4 blocks and scales (uint8), read as a jspec.mxfp4.Mxfp4Weight."""
        return (self.layout or "").startswith("mxfp4")


class SpecList(list):
    """The ParamSpecs of one model, in load order, appended through ``add``."""

    def add(self, path, sources, source_shapes, shape=None, integer=False, split=None, vocab=False, quant=None,
            layout=None):
        """A leaf at ``path``; ``shape`` defaults to the sources' concatenation on axis 0;
        ``split``: the axis tensor parallelism shards (ParamSpec.split); ``vocab``: a
        vocabulary table, split by its rows and padded (ParamSpec.vocab); ``quant``: its
        scales when quantized (ParamSpec.quant); ``layout``: ParamSpec.layout."""
        source_shapes = tuple(tuple(s) for s in source_shapes)
        cat = (sum(s[0] for s in source_shapes),) + source_shapes[0][1:]
        split = 0 if vocab else split
        self.append(ParamSpec(tuple(path), tuple(shape or cat), tuple(sources), source_shapes, integer, split, vocab,
                              quant, layout))


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported (choose from {sorted(DTYPES)})")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def set_path(tree: dict, path: tuple[str, ...], value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def check_specs(src, specs: list[ParamSpec], folder: str, what: str, ignored=()):
    """Every source tensor of ``specs`` is in ``src`` with its shape and kind (floating point,
    or integer for integer leaves; float8_e4m3fn where, and only where, the leaf is quantized
    from the file, with its scales: quantized.check_quant), else CheckpointError. Tensors of ``src`` that no spec
    reads are logged as a warning (transformers warns of them too), except ``ignored``
    names (those a format carries and jspec has no use for).

    ``what`` names the folder's role in the missing-tensor message ("checkpoint",
    "drafter checkpoint").
    """
    for spec in specs:
        for name, want in zip(spec.sources, spec.source_shapes):
            if name not in src:
                raise CheckpointError(f"{what} {folder!r} is missing tensor {name!r}")
            got = tuple(src.shape(name))
            if got != tuple(want):
                raise CheckpointError(
                    f"tensor {name!r} in {folder!r} has shape {list(got)}, expected {list(want)} from config.json"
                )
            integer = spec.integer or spec.packed
            if src.is_float(name) == integer:
                raise CheckpointError(f"tensor {name!r} in {folder!r} is stored as {src.dtype(name)}: expected "
                                      f"{'an integer' if integer else 'a floating-point'} tensor")
        if not spec.integer:
            check_quant(src, spec, folder)
    used = {n for spec in specs for n in spec.sources}
    used |= {n for spec in specs if spec.quant is not None for n in spec.quant.scales + spec.quant.unread}
    if unused := sorted(n for n in src.names() if n not in used and n not in ignored):
        logger.warning("%s %r: %d tensor(s) not used by jspec (%s%s)", what, folder, len(unused),
                       ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")


def load_params(src, specs: list[ParamSpec], dtype, sharding=None, progress=None) -> dict:
    """The param tree of ``specs``, read from ``src`` one tensor at a time (check_specs first).

    Float leaves are cast to ``dtype``, integer leaves kept int32; each leaf is placed on
    ``sharding`` when given: a jax Sharding, or a ``jspec.parallel.Placement`` (tensor
    parallelism: each device reads only its own slice of each tensor). ``progress`` None
    shows a tqdm bar for checkpoints over 1 GiB.
    """
    from jspec.parallel.placement import Placement

    if progress is None:
        progress = src.nbytes() > (1 << 30)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(s.sources) for s in specs), desc="loading weights", unit="tensor")

    def read(src, spec, dtype):  # one plain leaf
        if spec.layout is not None:
            return rearranged(src, spec, dtype)
        if isinstance(sharding, Placement):
            return sharding.load_leaf(src, spec, dtype)
        parts = []
        for name in spec.sources:
            if spec.integer:
                parts.append(jnp.asarray(np.asarray(src.get_int(name)).astype(np.int32)))
            else:
                parts.append(jnp.asarray(src.get(name)).astype(dtype))
        arr = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        if arr.shape != spec.shape:
            arr = arr.reshape(spec.shape)
        return arr if sharding is None else jax.device_put(arr, sharding)

    def rearranged(src, spec, dtype):  # a leaf of ParamSpec.layout, made on the host
        from jspec.checkpoint.gpt_oss_layout import LAYOUTS

        if isinstance(sharding, Placement):
            raise CheckpointError(f"{spec.sources[0]!r}: tensor parallelism does not split {spec.layout} tensors yet")
        parts = [np.asarray(src.get_int(n)) if spec.packed else np.asarray(jnp.asarray(src.get(n), jnp.float32))
                 for n in spec.sources]
        arr = LAYOUTS[spec.layout](*parts)
        if spec.packed:  # kept packed on the device (jspec/mxfp4.py)
            blocks, scales = arr
            arr = Mxfp4Weight(place(jnp.asarray(blocks), spec), place(jnp.asarray(scales), spec),
                              jnp.dtype(dtype).name)
        if tuple(arr.shape) != spec.shape:
            raise CheckpointError(f"{spec.sources[0]!r}: {spec.layout} gave shape {list(arr.shape)}, expected "
                                  f"{list(spec.shape)} from config.json")
        return arr if spec.packed else place(jnp.asarray(arr).astype(dtype), spec)

    def place(arr, spec):  # an array made here (a weight quantized at load) where ``read`` puts that leaf
        if isinstance(sharding, Placement):
            return jax.device_put(arr, sharding.sharding(spec))
        return arr if sharding is None else jax.device_put(arr, sharding)

    params: dict = {}
    for spec in specs:
        set_path(params, spec.path, read(src, spec, dtype) if spec.quant is None
                 else read_quant(src, spec, dtype, read, place))
        if bar is not None:
            bar.update(len(spec.sources))
    if bar is not None:
        bar.close()
    return params
