"""Fixtures of tests/gpu/ (the lines of scripts/gpu_check.py): the checkpoints that
``python scripts/gpu_check.py --build DIR`` wrote (``--gpu-ckpts DIR``, tests/conftest.py),
and the backend the lines run on (the CPU unless JAX_PLATFORMS names another:
tests/conftest.py).

On a CPU machine the lines that need a GPU skip, the others run as a smoke test (the jnp
and interpreted kernels, small sizes). A line reports its figures for the report with
pytest's ``record_property("detail", text)``; scripts/gpu_check.py reads them from the
test reports (the performance table: ``record_property("perf", rows)``).
"""

from __future__ import annotations

import gc
import os

import pytest

from tests.helpers.gpu_lines import use_checkpoints


@pytest.fixture(scope="session")
def gpu_refs(request) -> dict:
    """references.json of the --gpu-ckpts folder, with tests/helpers/spec_e2e.py pointed at
    its checkpoints."""
    return use_checkpoints(request.config.getoption("--gpu-ckpts"))


@pytest.fixture(scope="session")
def gpu_ckpts(request, gpu_refs) -> str:
    """The --gpu-ckpts folder (absolute)."""
    return os.path.abspath(request.config.getoption("--gpu-ckpts"))


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    """jax's backend is a GPU (else the lines are a CPU smoke test)."""
    import jax

    return jax.default_backend() == "gpu"


@pytest.fixture(scope="session")
def perf_steps(request) -> int:
    return request.config.getoption("--gpu-perf-steps")


@pytest.fixture(autouse=True)
def _free_engines():
    yield
    gc.collect()  # a line's engines (reference cycles) give their device memory back
