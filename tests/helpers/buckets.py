"""Fewer shape buckets for the CPU tests' engines (tests/conftest.py installs it).

The suite is mostly XLA's CPU compiler: one program per (token, sequence) bucket an engine
meets. Wrapped here, FlatShapes.create folds the small buckets of each family into one (the
smallest bucket of at least 8 sequences / 64 tokens, or the largest where the engine's are
smaller: the tests' small engines get one bucket per family), so most steps are padded: a
step's results must not depend on its padding. Larger buckets stay (an engine of 256
sequences padding every step to them would run longer than it compiles). The production
bucket sets stay under test where a test is about them (marker ``production_buckets``:
warmup, the compile closure, shape counts; the newcomer and README files, as a user runs
them) and on the GPU (scripts/gpu_check.py passes
--gpu-ckpts: nothing is wrapped). A child process a test starts
(tests.helpers.multihost_node) follows the test's mode through JSPEC_TEST_BUCKETS."""

from __future__ import annotations

import os

_MODE = {"mode": "production", "wrapped": False}


def wrap_flat_shapes():
    """FlatShapes.create, from now on, as the mode says (once per process)."""
    if _MODE["wrapped"]:
        return
    from jspec.engine import flat_input

    create = flat_input.FlatShapes.create.__func__

    def create_for_tests(cls, *args, **kwargs):
        shapes = create(cls, *args, **kwargs)
        if _MODE["mode"] == "production":
            return shapes
        return cls(_fold(shapes.batch, 8), _fold(shapes.tokens, 64), shapes.q, shapes.max_chunk, shapes.widths)

    flat_input.FlatShapes.create = classmethod(create_for_tests)
    _MODE["wrapped"] = True


def _fold(buckets: tuple[int, ...], least: int) -> tuple[int, ...]:
    """The buckets from the first one >= least (or the largest) on."""
    return tuple(b for b in buckets if b >= min(least, buckets[-1]))


def set_mode(mode: str):
    assert mode in ("fewer", "production"), mode
    _MODE["mode"] = mode


def bucket_mode() -> str:
    """"fewer" or "production": what FlatShapes.create makes now (part of the key of the
    engines tests cache across tests)."""
    return _MODE["mode"]


def child_env() -> dict:
    """The environment entry giving a child process the running test's mode."""
    return {"JSPEC_TEST_BUCKETS": _MODE["mode"]}


def from_env():
    """In a child process: the parent test's mode (production when unset)."""
    if os.environ.get("JSPEC_TEST_BUCKETS") == "fewer":
        wrap_flat_shapes()
        set_mode("fewer")
