"""Shared fixtures, for every folder under tests/: the tiny HF checkpoints of
tests/helpers/targets.py, built once per session. The tests marked ``gpu`` (tests/gpu: the
lines of scripts/gpu_check.py) are skipped unless ``--gpu-ckpts DIR`` is given."""

from __future__ import annotations

import os

import pytest

from tests.helpers import buckets
from tests.helpers.targets import hf_checkpoint

# CI has no accelerator: the CPU unless JAX_PLATFORMS says otherwise. The GPU check's lines
# (tests/gpu) run on the GPU only so: scripts/gpu_check.py sets it to "" (jax's own choice)
# where unset; by hand, `JAX_PLATFORMS=cuda pytest tests/gpu --gpu-ckpts DIR`.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_addoption(parser):
    # Here, not in tests/gpu/conftest.py: pytest reads options only from the conftest files it
    # loads at start, and `pytest tests` does not load that one.
    parser.addoption("--gpu-ckpts", metavar="DIR", default=None,
                     help="run the tests marked gpu (tests/gpu) on the checkpoints that "
                          "`python scripts/gpu_check.py --build DIR` wrote")
    parser.addoption("--gpu-perf-steps", type=int, default=24,
                     help="timed steps per row of the GPU check's performance table (tests/gpu/test_perf.py)")


# Fewer shape buckets for the CPU tests' engines (tests/helpers/buckets.py: a third less
# compiling; tests/engine took 268 s with every bucket, 180 s so, 2026-11-30), the real
# sets for a test marked production_buckets and on the GPU.
def pytest_configure(config):
    if not config.getoption("--gpu-ckpts"):
        buckets.wrap_flat_shapes()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before any fixture of the test is set up: module-scoped engines are built in its mode
    real = item.config.getoption("--gpu-ckpts") or item.get_closest_marker("production_buckets")
    buckets.set_mode("production" if real else "fewer")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-ckpts"):
        return
    skip = pytest.mark.skip(reason="a GPU check line: scripts/gpu_check.py runs it (or pytest --gpu-ckpts DIR)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session", params=["llama_tied", "llama_untied", "qwen3", "qwen3_moe"])
def target(request, ckpt_root):
    return (request.param,) + hf_checkpoint(ckpt_root, request.param)


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_root):
    return hf_checkpoint(ckpt_root, "llama_tied")
