"""Kernel backends: which implementation of a kernel-backed op runs, as a typed value.

The user names an implementation by string (EngineConfig.attn_impl / linear_impl /
sample_impl, JSPEC_KERNEL_IMPL); ``parse_impl`` turns each name into a backend once, when
the engine's KernelPlan is made (jspec/kernel_plan.py), and the ops facade (jspec/ops.py,
jspec/ops_attention.py) picks each kernel file's function from it by type:

    "reference"      XLA()                   the kernel file's jnp reference, compiled by XLA
    "gpu"            GPU()                   the Triton-backend Pallas kernel
    "interpret"      GPU(interpret=True)     the same kernel body in Pallas' interpreter (any platform)
    "tpu"            TPU()                   the Mosaic TPU Pallas kernel
    "tpu_interpret"  TPU(interpret=True)     the TPU kernel under pltpu.InterpretParams (on CPU)

Backends are frozen dataclasses: hashable, compared by value, static under jit.
"""

from __future__ import annotations

import dataclasses
import logging


@dataclasses.dataclass(frozen=True)
class XLA:
    """The jnp references, compiled by XLA for whatever platform runs them."""

    @property
    def name(self) -> str:
        return "reference"


@dataclasses.dataclass(frozen=True)
class GPU:
    """The Triton-backend Pallas kernels; ``interpret``: their bodies run by Pallas'
    interpreter (any platform: how CPU tests check them)."""

    interpret: bool = False

    @property
    def name(self) -> str:
        return "interpret" if self.interpret else "gpu"


@dataclasses.dataclass(frozen=True)
class TPU:
    """The Mosaic TPU Pallas kernels; ``interpret``: under pltpu.InterpretParams (checks TPU
    semantics on a CPU)."""

    interpret: bool = False

    @property
    def name(self) -> str:
        return "tpu_interpret" if self.interpret else "tpu"


Backend = XLA | GPU | TPU

# The user-facing names, in the order error messages list them.
IMPLS = {"reference": XLA(), "gpu": GPU(), "tpu": TPU(), "interpret": GPU(interpret=True),
         "tpu_interpret": TPU(interpret=True)}


def parse_impl(impl: str, source: str = "impl") -> Backend | None:
    """The backend ``impl`` names, None for "auto"; any other name a ValueError naming
    ``source`` (the config field or variable it came from)."""
    if impl == "auto":
        return None
    if impl not in IMPLS:
        raise ValueError(f"{source}={impl!r} is not one of {tuple(IMPLS) + ('auto',)}")
    return IMPLS[impl]


def platform_kernels(platform: str) -> Backend:
    """What "auto" means on a JAX platform (jax.default_backend()): the references on "cpu"
    (Pallas' interpreter runs the kernels there for tests, far too slowly to serve with),
    GPU() on "gpu" / "cuda" / "rocm", TPU() on "tpu", and on any other platform the GPU
    kernels' bodies in the interpreter."""
    if platform == "cpu":
        return XLA()
    if platform in ("gpu", "cuda", "rocm"):
        return GPU()
    if platform == "tpu":
        return TPU()
    return GPU(interpret=True)


_log = logging.getLogger("jspec.kernels")
_fallbacks_logged: set = set()


def shape_fallback(kernel: str, backend: Backend, reason: str | None) -> Backend:
    """``backend``, or XLA() (the jnp path) when ``reason`` says the kernel cannot take the
    shape (e.g. a head_dim its tiles do not cover). A model with such a shape still runs, on
    XLA; one log line per kernel and reason says so."""
    if reason is None:
        return backend
    if (kernel, reason) not in _fallbacks_logged:
        _fallbacks_logged.add((kernel, reason))
        _log.warning("%s: %s; using the XLA path instead of the %r kernel", kernel, reason, backend.name)
    return XLA()
