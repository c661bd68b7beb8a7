"""Pack a step's host arrays into two buffers: one int32, one float32.

A step has a dozen small inputs (tokens, positions, slots, page table, sampling params);
sent one by one, each pays a host->device transfer (~0.1 ms each on the H200, measured: the
largest host cost of a batch-1 decode step). Packed, the step pays two. The layout (tree
structure, shapes, dtypes) is static: it only changes with the shape bucket, which
recompiles anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack(tree):
    """tree of numpy arrays -> (i32[N], f32[M], layout). Bools travel as int32."""
    leaves, treedef = jax.tree.flatten(tree)
    ints, floats, layout = [], [], []
    for x in leaves:
        x = np.asarray(x)
        kind = "f" if x.dtype == np.float32 else "i"
        (floats if kind == "f" else ints).append(x.reshape(-1).astype(np.float32 if kind == "f" else np.int32))
        layout.append((kind, x.shape, x.dtype.str))
    i = np.concatenate(ints) if ints else np.zeros((0,), np.int32)
    f = np.concatenate(floats) if floats else np.zeros((0,), np.float32)
    return i, f, (treedef, tuple(layout))


def unpack(ints, floats, layout):
    """Inverse of pack, inside jit (static layout)."""
    treedef, items = layout
    leaves, oi, of = [], 0, 0
    for kind, shape, dt in items:
        n = int(np.prod(shape))
        if kind == "f":
            x, of = floats[of : of + n], of + n
        else:
            x, oi = ints[oi : oi + n], oi + n
        leaves.append(x.reshape(shape).astype(jnp.dtype(dt)))
    return jax.tree.unflatten(treedef, leaves)


def layout_tokens(layout) -> int:
    """The length T of a packed tree's ``tokens`` leaf (a FlatInput's i32[T]) from its layout;
    0 for a tree without one (a split step's tail's SampleInput)."""
    treedef, items = layout
    shape = getattr(jax.tree.unflatten(treedef, [shape for _, shape, _ in items]), "tokens", None)
    return shape[-1] if shape else 0
