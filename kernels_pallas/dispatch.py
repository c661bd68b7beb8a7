"""Kernel implementations by name, and what "auto" means for a direct kernel call.

Every public kernel entry takes ``impl``:
- "reference":     the kernel file's pure-jnp reference;
- "gpu":           the GPU lowering (compiled Pallas);
- "tpu":           the TPU lowering (Mosaic TPU);
- "interpret":     the GPU kernel body run by Pallas' interpreter (`interpret=True`), any backend;
- "tpu_interpret": the TPU kernel under `pltpu.InterpretParams()` (checks TPU semantics on CPU);
- "auto":          the kernel for jax.default_backend(): gpu -> "gpu", tpu -> "tpu", anything
                   else (cpu) -> "interpret", so a kernel test on CPU runs the kernel body.
The engine never passes "auto": its kernel plan (jspec/ops.py, plan_kernels) hands every
entry a concrete name, and "auto" there means the references on CPU.
"""

from __future__ import annotations

import logging

import jax

IMPLS = ("reference", "gpu", "tpu", "interpret", "tpu_interpret")
GPU_IMPLS = ("gpu", "interpret")  # the Triton-backend kernel bodies, compiled or interpreted


def backend_impl(backend: str) -> str:
    """The kernel implementation for a JAX backend name (see the module docstring)."""
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if backend == "tpu":
        return "tpu"
    return "interpret"


def check_impl(impl: str, source: str = "impl") -> str:
    """``impl`` if it names an implementation (or "auto"), else a ValueError naming ``source``."""
    if impl != "auto" and impl not in IMPLS:
        raise ValueError(f"{source}={impl!r} is not one of {IMPLS + ('auto',)}")
    return impl


def resolve_impl(impl: str = "auto") -> str:
    """Concrete implementation name for `impl` (see module docstring)."""
    check_impl(impl)
    return backend_impl(jax.default_backend()) if impl == "auto" else impl


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
