"""Tensor parallelism on 8 virtual CPU devices.

``--xla_force_host_platform_device_count`` is read when jax starts its CPU backend, so it is
set here, before any test module imports jax; that is why this folder runs in a pytest
process of its own (scripts/test.sh's groups).
"""

from __future__ import annotations

import os

import pytest

DEVICES = 8
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    import jax

    if len(jax.devices()) < DEVICES:
        pytest.fail(f"tests/parallel needs {DEVICES} CPU devices and jax sees {len(jax.devices())}: jax was "
                    "imported before tests/parallel/conftest.py set XLA_FLAGS (run this folder in its own process)")
