"""One dispatch point for every Pallas kernel in kernels_pallas.

`resolve_impl(impl)` turns a requested implementation into a concrete one:
- "reference":     the kernel file's pure-jnp reference;
- "gpu":           the GPU lowering (compiled Pallas);
- "tpu":           the TPU lowering (Mosaic TPU);
- "interpret":     the GPU kernel body run by Pallas' interpreter (`interpret=True`), any backend;
- "tpu_interpret": the TPU kernel under `pltpu.InterpretParams()` (checks TPU semantics on CPU);
- "auto":          the env var JSPEC_KERNEL_IMPL if set (any of the names above except
                   "auto"), else from jax.default_backend(): gpu -> "gpu", tpu -> "tpu",
                   anything else (cpu) -> "interpret".
An explicit impl other than "auto" always wins over the env var. The env var is read at
trace time, so set it before the first call of a jitted function.
"""

from __future__ import annotations

import logging
import os

import jax

ENV_VAR = "JSPEC_KERNEL_IMPL"
IMPLS = ("reference", "gpu", "tpu", "interpret", "tpu_interpret")


def resolve_impl(impl: str = "auto") -> str:
    """Concrete implementation name for `impl` (see module docstring)."""
    if impl == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env != "auto":
            if env not in IMPLS:
                raise ValueError(f"{ENV_VAR}={env!r} is not one of {IMPLS + ('auto',)}")
            return env
        backend = jax.default_backend()
        if backend in ("gpu", "cuda", "rocm"):
            return "gpu"
        if backend == "tpu":
            return "tpu"
        return "interpret"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS + ('auto',)}")
    return impl


_log = logging.getLogger("jspec.kernels")
_fallbacks_logged: set = set()


def shape_fallback(kernel: str, impl: str, reason: str | None) -> str:
    """``impl``, or "reference" (the jnp / XLA path) when ``reason`` says the kernel
    cannot take the shape (e.g. a head_dim its tiles do not cover). A model with such a
    shape still runs, on XLA; one log line per kernel and reason says so."""
    if reason is None:
        return impl
    if (kernel, reason) not in _fallbacks_logged:
        _fallbacks_logged.add((kernel, reason))
        _log.warning("%s: %s; using the XLA path instead of the %r kernel", kernel, reason, impl)
    return "reference"
