"""Where each parameter leaf lives on the mesh, and how each device reads only its part.

A leaf's ``ParamSpec.split`` (jspec/checkpoint/param_spec.py) is the axis sharded over the
"tp" mesh axis. ``Placement.load_leaf`` builds the sharded array with
``jax.make_array_from_callback``: each device's block is read with the tensor source's
``get_part`` (safetensors' ``get_slice``: only those bytes leave the file), so the host holds
one device's slice of one tensor at a time. A leaf of several sources split on axis 0 (q|k|v,
gate|up, DFlash's k|v) is stored tp-interleaved: device i holds [slice i of source 0 | slice i
of source 1 | ...], so every device computes whole local q/k/v (gate/up) columns with no
communication; ``jspec.ops.split_fused`` reads that layout. With tp == 1 it is the plain
concatenation. A vocabulary table (``ParamSpec.vocab``) that tp does not divide is held with
zero rows appended up to a multiple of tp (``Placement.shape``, ``padded_vocab``): the last
device's block ends in them, made on the host, never read from the file. An FP8 leaf's weight
and scale are read as two such leaves (jspec/checkpoint/quantized.py: scale_spec): a
column-parallel leaf's scales split by rows with it, a row-parallel leaf's per-channel scales
replicated and its block scales split by block columns; each device's slice must then hold
whole blocks (``check_quant``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.parallel.mesh import TP_AXIS, check_drafter, check_target, padded_vocab, put


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

    def shape(self, spec) -> tuple[int, ...]:
        """The leaf's shape on the mesh: ``spec.shape``, a vocabulary's rows padded to a
        multiple of tp (the modules declare the same: ops.vocab_rows)."""
        if not spec.vocab or self.tp == 1:
            return tuple(spec.shape)
        return (padded_vocab(spec.shape[0], self.tp),) + tuple(spec.shape[1:])

    def restore_sharding(self, spec) -> NamedSharding:
        """Where an orbax restore reads the leaf (``spec.shape``): its sharding, or
        replicated for a vocabulary padded on the mesh (from_concatenated pads it then)."""
        return self.sharding(spec) if self.shape(spec) == tuple(spec.shape) else NamedSharding(self.mesh, P())

    def check_target(self, cfg):
        check_target(cfg, self.tp)

    def check_drafter(self, cfg):
        check_drafter(cfg, self.tp)

    def check_quant(self, specs):
        """Each device's slice of a block-quantized leaf holds whole blocks, so its scale
        splits with it: rows (column parallel) or columns (row parallel) a multiple of tp
        blocks. ValueError naming the tensor."""
        for spec in specs:
            q = spec.quant
            if self.tp == 1 or spec.split is None or q is None or q.block is None:
                continue
            ax, b = spec.split, q.block[spec.split]
            for name, shape in zip(spec.sources, spec.source_shapes):
                if shape[ax] % (self.tp * b):
                    raise ValueError(f"tensor parallel size {self.tp}: axis {ax} of tensor {name!r} (shape "
                                     f"{list(shape)}) does not split into whole quantization blocks of {b}")

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
            return put(np.concatenate(parts, axis=0).reshape(spec.shape), sharding)
        if self.tp == 1 or spec.split is None:
            parts = [jnp.asarray(src.get(n)).astype(dtype) for n in spec.sources]
            arr = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
            return put(arr.reshape(spec.shape), sharding)
        shape = self.shape(spec)
        if shape != tuple(spec.shape):
            return jax.make_array_from_callback(shape, sharding, lambda index: self._vocab_part(src, spec, index, dtype))
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

    def _vocab_part(self, src, spec, index, dtype):
        """A padded vocabulary's block (rows ``index[0]`` of the padded table): the file's
        rows it covers, then zero rows."""
        V = spec.shape[0]
        start, stop, _ = index[0].indices(self.shape(spec)[0])
        real = min(stop, V) - start
        zeros = np.zeros((stop - start - max(real, 0),) + tuple(spec.shape[1:]), np.float32)
        if real <= 0:
            return jnp.asarray(zeros, dtype)
        rows = jnp.asarray(src.get_part(spec.sources[0], (slice(start, start + real),) + tuple(index[1:])))
        return jnp.concatenate([rows.astype(dtype), jnp.asarray(zeros, dtype)], axis=0)

    def place(self, arr, spec) -> jax.Array:
        """A leaf already on a device (random weights), onto its sharding, rows as they are
        (from_concatenated then puts a fused leaf's rows in the tp-interleaved layout); a
        vocabulary padded with zero rows (shape)."""
        pad = self.shape(spec)[0] - arr.shape[0]
        if pad:
            arr = jnp.pad(arr, ((0, pad),) + ((0, 0),) * (arr.ndim - 1))
        return put(arr, self.sharding(spec))

    def from_concatenated(self, arr, spec) -> jax.Array:
        """A leaf in the plain concatenated layout (an orbax checkpoint, restored sharded:
        restore_sharding) in the tp-interleaved one: one row gather on the devices; a
        vocabulary restored whole, padded and split (place)."""
        if tuple(arr.shape) != self.shape(spec):
            return self.place(arr, spec)
        if self.tp == 1 or spec.split != 0 or len(spec.sources) == 1:
            return arr
        offsets = np.cumsum([0] + [s[0] for s in spec.source_shapes])
        perm = np.concatenate([np.arange(o + j * s[0] // self.tp, o + (j + 1) * s[0] // self.tp)
                               for j in range(self.tp) for o, s in zip(offsets, spec.source_shapes)])
        return jax.jit(lambda a: jnp.take(a, perm, axis=0), out_shardings=self.sharding(spec))(arr)
