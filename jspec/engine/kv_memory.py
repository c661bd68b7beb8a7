"""The KV page pool sized from a device's free memory (``EngineConfig.gpu_memory_utilization``)."""

from __future__ import annotations

import jax
import numpy as np

from jspec.checkpoint.target import resolve_dtype


def pages_from_memory(c, mc, dcfg, par, pages_per_seq: int) -> int:
    """Pages that fit ``c.gpu_memory_utilization`` of device 0's memory (``c``: the
    EngineConfig, ``mc``: the target's ModelConfig, ``dcfg``: the drafter's config or None,
    ``par``: the engine's parallel.EngineMesh). On the CPU, or without memory stats, what
    max_num_seqs full sequences need."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit or jax.default_backend() == "cpu":
        return c.max_num_seqs * pages_per_seq
    itemsize = np.dtype(resolve_dtype(c.dtype)).itemsize
    # K and V of every target layer, and of every drafter layer (its own cache over the same
    # page ids) when speculating; per device (tensor parallel: kv_heads / tp where sharded).
    layers = [(mc.num_layers, par.local_kv_heads(mc.num_kv_heads), mc.head_dim)]
    if dcfg is not None:
        layers.append((dcfg.num_layers, par.local_kv_heads(dcfg.num_kv_heads, draft=True), dcfg.head_dim))
    page_bytes = sum(2 * n * c.page_size * kvh * d * itemsize for n, kvh, d in layers)
    free = limit * c.gpu_memory_utilization - stats.get("bytes_in_use", 0)
    return max(pages_per_seq, int(free // page_bytes))
