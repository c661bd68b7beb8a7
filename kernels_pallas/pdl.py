"""Programmatic dependent launch (PDL) from Pallas Triton kernels.

XLA on Hopper (xla_gpu_enable_pdl, on by default in jax 0.11.x) launches Pallas Triton
kernels with programmatic stream serialization and puts a `griddepcontrol.wait` at their
entry. A kernel that never calls `griddepcontrol.launch_dependents` releases its successor
only as its programs exit. `launch_dependents(x)` calls it at the point x is computed (the
kernels pass their accumulator's zero init, so it runs before their weight stream): the
successor's programs can then be placed on the SMs while this kernel still streams, and pass
their wait as soon as this kernel's writes are visible. Safe for any successor: one launched
without PDL waits for this kernel's completion as usual, and one launched with it waits in
`griddepcontrol.wait`.

`enabled()` reads JSPEC_PDL_TRIGGER (default "1"; "0" turns it off) at trace time. The
interpreter has no inline assembly, so kernels call this only when compiled for the GPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

ENV_VAR = "JSPEC_PDL_TRIGGER"


def mode() -> str:
    """"early" (before the weight stream), "late" (after it, before the epilogue) or "off"."""
    m = os.environ.get(ENV_VAR, "off").strip().lower()
    return {"1": "early", "0": "off", "": "off"}.get(m, m)


def enabled() -> bool:
    return mode() != "off"


def launch_dependents(x):
    """x (an f32 block), returned through inline PTX that first executes
    griddepcontrol.launch_dependents in every thread. The asm is pure for Triton, so
    the result must be used (it is: callers start their accumulators from it)."""
    if x.dtype != jnp.float32:
        raise TypeError(f"launch_dependents takes an f32 block, got {x.dtype}")
    (y,) = plt.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.f32 $0, $1;",
        args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y
