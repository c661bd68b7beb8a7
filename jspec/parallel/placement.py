"""Where each parameter leaf lives on the mesh, and how each device reads only its part.

A leaf's ``ParamSpec.split`` (jspec/checkpoint/param_spec.py) is the axis sharded over the
"tp" mesh axis. ``Placement.load_leaf`` builds the sharded array with
``jax.make_array_from_callback``: each device's block is read with the tensor source's
``get_part`` (safetensors' ``get_slice``: only those bytes leave the file), so the host holds
one device's slice of one tensor at a time. A leaf of several sources split on axis 0 (q|k|v,
gate|up, DFlash's k|v) is stored tp-interleaved: device i holds [slice i of source 0 | slice i
of source 1 | ...], so every device computes whole local q/k/v (gate/up) columns with no
communication; ``jspec.ops.split_fused`` reads that layout. With tp == 1 it is the plain
concatenation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.parallel.mesh import TP_AXIS, check_drafter, check_target


@dataclasses.dataclass(frozen=True)
class Placement:
    """Parameters of one model (the target, or a drafter) on ``mesh``, split ``tp`` ways
    (1: replicated on every device of the mesh: a replicated drafter)."""

    mesh: Mesh
    tp: int

    def partition(self, spec) -> P:
        if self.tp == 1 or spec.split is None:
            return P()
        axes = [None] * len(spec.shape)
        axes[spec.split] = TP_AXIS
        return P(*axes)

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, self.partition(spec))

    def check_target(self, cfg):
        check_target(cfg, self.tp)

    def check_drafter(self, cfg):
        check_drafter(cfg, self.tp)

    def _check_split(self, spec):
        ax = spec.split
        for name, shape in zip(spec.sources, spec.source_shapes):
            if shape[ax] % self.tp:
                raise ValueError(f"tensor parallel size {self.tp} does not divide axis {ax} of tensor {name!r} "
                                 f"(shape {list(shape)})")
        if len(spec.sources) > 1 and ax != 0:
            raise ValueError(f"{'/'.join(spec.path)}: a leaf of several tensors splits on axis 0 only")

    def load_leaf(self, src, spec, dtype) -> jax.Array:
        """The leaf of ``spec`` read from ``src`` (a tensor source) onto the mesh."""
        sharding = self.sharding(spec)
        if spec.integer:
            parts = [np.asarray(src.get_int(n)).astype(np.int32) for n in spec.sources]
            return jax.device_put(np.concatenate(parts, axis=0).reshape(spec.shape), sharding)
        if self.tp == 1 or spec.split is None:
            parts = [jnp.asarray(src.get(n)).astype(dtype) for n in spec.sources]
            arr = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
            return jax.device_put(arr.reshape(spec.shape), sharding)
        self._check_split(spec)
        ax, tp = spec.split, self.tp
        block = spec.shape[ax] // tp

        def part(index):  # this device's block, in global (tp-interleaved) coordinates
            start = index[ax].indices(spec.shape[ax])[0]
            if len(spec.sources) == 1:
                return jnp.asarray(src.get_part(spec.sources[0], index)).astype(dtype)
            j = start // block  # the device's shard number: its slice of every source
            rest = tuple(index[1:])
            return jnp.concatenate([
                jnp.asarray(src.get_part(n, (slice(j * s[0] // tp, (j + 1) * s[0] // tp),) + rest)).astype(dtype)
                for n, s in zip(spec.sources, spec.source_shapes)], axis=0)

        return jax.make_array_from_callback(tuple(spec.shape), sharding, part)

    def place(self, arr, spec) -> jax.Array:
        """A leaf already on a device (random weights), onto its sharding, rows as they are
        (from_concatenated then puts a fused leaf's rows in the tp-interleaved layout)."""
        return jax.device_put(arr, self.sharding(spec))

    def from_concatenated(self, arr, spec) -> jax.Array:
        """A leaf in the plain concatenated layout (an orbax checkpoint, restored sharded)
        in the tp-interleaved one: one row gather on the devices."""
        if self.tp == 1 or spec.split != 0 or len(spec.sources) == 1:
            return arr
        offsets = np.cumsum([0] + [s[0] for s in spec.source_shapes])
        perm = np.concatenate([np.arange(o + j * s[0] // self.tp, o + (j + 1) * s[0] // self.tp)
                               for j in range(self.tp) for o, s in zip(offsets, spec.source_shapes)])
        return jax.jit(lambda a: jnp.take(a, perm, axis=0), out_shardings=self.sharding(spec))(arr)
