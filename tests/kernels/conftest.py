"""Fixtures of tests/kernels/: chip descriptions that let the Pallas kernels lower for GPU
and TPU on a CPU-only machine (tests/kernels/test_lowering.py, test_kernel_plan.py)."""

from __future__ import annotations

import contextlib

import jax
import pytest


@pytest.fixture(params=["v5e", "v6e"])
def tpu_chip(request):
    """Make Mosaic TPU lowering work on a CPU-only machine, as the given TPU chip.

    Why private jax modules: Mosaic's lowering rules ask jax for the chip's description
    (jax._src.pallas.mosaic.tpu_info.get_tpu_info(), e.g. its generation and sublane /
    lane counts), looked up by the default device's kind, and a CPU device has none. The
    module keeps `registry` (device kind -> factory of a TpuInfo) for kinds it does not
    know; registering the CPU device kind there, with the chip's own description from
    get_tpu_info_for_chip, is the smallest change that lets the lowering run. get_tpu_info
    caches its answer, so the cache is cleared on the way in and out. (jax 0.11 moved the
    module to jax._src.tpu_info and left a forwarding shim with the same names.)"""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError as e:  # pragma: no cover - other jax versions
        pytest.skip(f"jax {jax.__version__}: cannot import jax._src.pallas.mosaic.tpu_info ({e})")
    for name in ("registry", "get_tpu_info", "get_tpu_info_for_chip", "ChipVersion"):
        if not hasattr(tpu_info, name):
            pytest.skip(f"jax {jax.__version__}: jax._src.pallas.mosaic.tpu_info has no attribute {name!r}")
    if not hasattr(tpu_info.get_tpu_info, "cache_clear"):
        pytest.skip(f"jax {jax.__version__}: tpu_info.get_tpu_info has no attribute 'cache_clear'")
    chip = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v6e": tpu_info.ChipVersion.TPU_V6E}[request.param]
    kind = jax.devices()[0].device_kind
    if tpu_info.chip_version_from_device_kind(kind) is not None:  # a real TPU: its own description
        yield request.param
        return
    info = tpu_info.get_tpu_info_for_chip(chip, 1)
    with _registered(tpu_info.registry, tpu_info.get_tpu_info, kind, info):
        assert tpu_info.get_tpu_info() is info  # the lowering will see this chip
        yield request.param


@contextlib.contextmanager
def _registered(registry, getter, kind, info):
    """``registry[kind]`` answers ``info`` inside the block; ``getter``'s cache is cleared
    on the way in and out, and the registry left as it was."""
    saved = registry.get(kind)
    registry[kind] = lambda: info
    getter.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            registry.pop(kind, None)
        else:
            registry[kind] = saved
        getter.cache_clear()


@pytest.fixture
def gpu_target():
    """Make the Pallas Triton lowering work on a CPU-only machine.

    jax 0.10 lowers for compute capability 9.0 when it finds no GPU. jax 0.11 asks
    jax._src.pallas.triton.gpu_info.get_gpu_info() for the default device's description
    instead, and has none for a CPU device: the same registry trick as tpu_chip registers
    an H100 (sm_90, the capability of the H100/H200 this project runs on) for the CPU
    device kind. Private module, hence isolated here; absent on jax 0.10 (nothing to do)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # jax 0.10: no description needed
        yield
        return
    for name in ("registry", "get_gpu_info", "get_gpu_info_from_version", "GpuVersion"):
        if not hasattr(gpu_info, name):
            pytest.skip(f"jax {jax.__version__}: jax._src.pallas.triton.gpu_info has no attribute {name!r}")
    kind = jax.devices()[0].device_kind
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    with _registered(gpu_info.registry, gpu_info.get_gpu_info, kind, info):
        yield
