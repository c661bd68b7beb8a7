"""Every environment variable jspec reads, declared here and read nowhere else.

Read through this module's attributes (``envs.JSPEC_KERNEL_IMPL``), each evaluated at
the time of the read. Only JSPEC_KERNEL_IMPL and JSPEC_FP8_GEMM can change compiled code,
and only through the kernel plan an engine makes once when it starts
(``jspec.ops.plan_kernels``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    JSPEC_KERNEL_IMPL: str | None
    JSPEC_FP8_GEMM: bool
    JSPEC_ALLOW_LONG_MAX_MODEL_LEN: bool
    JSPEC_CACHE: str
    JSPEC_COMPILATION_CACHE: bool
    JSPEC_COMPILATION_CACHE_MAX_GB: float
    VLLM_API_KEY: str | None
    VLLM_LOG_STATS_INTERVAL: float
    XLA_PYTHON_CLIENT_MEM_FRACTION: float | None


def _kernel_impl() -> str | None:
    value = os.environ.get("JSPEC_KERNEL_IMPL", "").strip().lower()
    return value if value and value != "auto" else None


def _cache_max_gb() -> float:
    value = os.environ.get("JSPEC_COMPILATION_CACHE_MAX_GB", "10")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"JSPEC_COMPILATION_CACHE_MAX_GB must be a number of GiB (<= 0: no limit), "
                         f"got {value!r}") from None


def _log_stats_interval() -> float:
    value = os.environ.get("VLLM_LOG_STATS_INTERVAL", "").strip()
    try:
        return float(value) if value else 10.0
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL={value!r} is not a number of seconds") from None


# JAX's GPU memory pool, read by jax when its backend starts: the share of each device it may
# take (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unset), or no pool (XLA_PYTHON_CLIENT_ALLOCATOR=platform).
JAX_DEFAULT_POOL_FRACTION = 0.75


def _pool_fraction() -> float | None:
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        return None
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
    try:
        return float(value) if value else JAX_DEFAULT_POOL_FRACTION
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a fraction of the device's memory, "
                         f"got {value!r}") from None


def set_pool_fraction(fraction: float) -> bool:
    """Sets XLA_PYTHON_CLIENT_MEM_FRACTION (for a jax backend not started yet) unless the user
    chose the pool (that variable, or XLA_PYTHON_CLIENT_ALLOCATOR); True if it did."""
    if any(os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")):
        return False
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
    return True


environment_variables: dict[str, Callable[[], Any]] = {
    # The kernel implementation wherever an EngineConfig asks for "auto" (attn_impl,
    # linear_impl, sample_impl): "reference" | "gpu" | "tpu" | "interpret" | "tpu_interpret"
    # (jspec.kernel_backend.IMPLS; jspec.ops.plan_kernels rejects other names). Unset or
    # "auto": chosen by backend. An impl named in the EngineConfig wins over it.
    "JSPEC_KERNEL_IMPL": _kernel_impl,
    # "0" / "false": FP8 weights' GEMMs of many rows stay weight-only (the FP8 weight converted
    # in the dot, bf16 activations). By default they run W8A8 where the checkpoint asks for FP8
    # activations and the GPU has FP8 tensor cores (KernelPlan.fp8_gemm: per-token dynamic
    # activation scales, vLLM's meaning): the 8B saturation workload with an FP8 KV cache took
    # 16.55 s this way against 22.36 s in bf16 (H200, 2026-11-30, docs/benchmarks.md).
    "JSPEC_FP8_GEMM": lambda: os.environ.get("JSPEC_FP8_GEMM", "1").strip().lower() not in ("0", "false", "off"),
    # "1" / "true": accept a max_model_len beyond the model's max_position_embeddings (its
    # positions past that were never trained). vLLM's name, VLLM_ALLOW_LONG_MAX_MODEL_LEN,
    # is honoured too.
    "JSPEC_ALLOW_LONG_MAX_MODEL_LEN": lambda: any(
        os.environ.get(k, "").strip().lower() in ("1", "true")
        for k in ("JSPEC_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")),
    # jspec's cache folder (compiled steps, below; the tests' tiny model,
    # tests/helpers/default_model.py); ~/.cache/jspec if unset.
    "JSPEC_CACHE": lambda: os.environ.get("JSPEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jspec")),
    # "0" / "false": jspec.LLM and the server leave jax's persistent compilation cache off
    # (jspec/compile_cache.py); otherwise compiled steps are kept in $JSPEC_CACHE/xla.
    "JSPEC_COMPILATION_CACHE": lambda: os.environ.get("JSPEC_COMPILATION_CACHE", "1").strip().lower()
    not in ("0", "false"),
    # The size limit of that cache, GiB (default 10; <= 0: none): the least recently used
    # entries go first. A cache the user configured keeps its own settings.
    "JSPEC_COMPILATION_CACHE_MAX_GB": _cache_max_gb,
    # The server's API key when --api-key is not given (vLLM's variable).
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY") or None,
    # Seconds between the server's periodic stats lines (vLLM's variable; default 10).
    "VLLM_LOG_STATS_INTERVAL": _log_stats_interval,
    # The share of each GPU's memory in JAX's pool (None: no pool), from jax's variables above;
    # jspec sets it from gpu_memory_utilization when unset (jspec/engine/kv_memory.py).
    "XLA_PYTHON_CLIENT_MEM_FRACTION": _pool_fraction,
}


# Prefixes of the variables that can change what XLA compiles, or how (jax's, XLA's, the TPU
# runtime's, jspec's): a stored executable's key holds them (jspec/engine/executables.py).
_COMPILER_PREFIXES = ("XLA_", "JAX_", "JSPEC_", "LIBTPU_", "TPU_", "NVIDIA_TF32", "CUDA_VISIBLE")


def compiler_environment() -> list[tuple[str, str]]:
    """The set variables of those prefixes, sorted by name."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith(_COMPILER_PREFIXES))


def __getattr__(name: str):
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
