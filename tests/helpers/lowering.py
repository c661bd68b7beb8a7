"""Reading what jax lowers a function to (tests/kernels/): the custom calls (Pallas kernels)
of a module lowered for a platform this machine does not have."""

from __future__ import annotations

import re

import jax

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"

_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)\(")


def custom_calls(text: str) -> list[tuple[str, str | None]]:
    """(call target, kernel name) of every custom call, in program order. The Triton call
    carries its name in the backend config (name = "..."), Mosaic's in kernel_name."""
    out = []
    for line in text.splitlines():
        m = _CALL.search(line)
        if not m:
            continue
        target = m.group(1)
        key = "kernel_name" if target == MOSAIC else "name"
        n = re.search(rf'\b{key} = "([^"]*)"', line)
        out.append((target, n.group(1) if n else None))
    return out


def lower(fn, args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
