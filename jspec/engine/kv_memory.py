"""The device memory an engine may use (``EngineConfig.gpu_memory_utilization``, vLLM's
share of the whole device), and the KV page pool sized from it and allocated.

JAX serves every array from a pool of XLA_PYTHON_CLIENT_MEM_FRACTION of each GPU (0.75
unless set), fixed when its backend starts, so vLLM's default of 0.9 could not be had: a
61 GB Qwen3-30B-A3B did not fit an 80 GB H100's 60 GB pool. ``claim_device_memory`` sets
the pool to the engine's utilization before the backend starts (the first engine of a
process; the user's own pool variables win), and ``pages_from_memory`` gives the KV cache
what the engine's share leaves after its weights, less TEMP_RESERVE for XLA's temporaries.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jspec import envs
from jspec.checkpoint.target import resolve_dtype
from jspec.engine.engine_config import kv_cache_dtype
from jspec.kv_cache import KVCache
from jspec.parallel.multihost import agree_min

logger = logging.getLogger("jspec.engine")

# The share of an engine's memory left to the buffers XLA's steps allocate as they run
# (activations, logits, attention's partial results); before this module's pool claim it was
# the implicit (1 - gpu_memory_utilization) of JAX's pool: 10% at vLLM's default.
TEMP_RESERVE = 0.1
# More where a step's logits are large: XLA's temporaries of a step hold several f32 [rows, V]
# arrays (the logits, the sampler's and the rejection's copies, a drafter's own logits). DFlash
# K=15 at 256 rows (4,096 logit rows of Qwen3's 151,936) asked one 16.31 GiB temp buffer on the
# H200, seven such arrays (11.9 GiB compiled for the CPU), above the 12.6 GB of TEMP_RESERVE:
# warmup ran out of memory beside the KV pool (2026-11-29).
LOGIT_COPIES = 8


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether a backend exists yet

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return True if probe is None else bool(probe())


def claim_device_memory(utilization: float) -> None:
    """Before jax's backend starts: its GPU pool set to ``utilization`` of each device (a
    no-op on CPU, where no pool exists). Nothing happens once a backend has started (jax used
    earlier in the process: its pool stays) or when the user set the pool's variables."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1] (a share of the device's memory), "
                         f"got {utilization}")
    if not _backend_started() and envs.set_pool_fraction(utilization):
        # said once the backend is known (no such pool on a CPU): the engine's first log line
        global _claimed
        _claimed = utilization


_claimed = None


def log_device_memory_claim() -> None:
    """Log the pool ``claim_device_memory`` set, on an accelerator, once."""
    global _claimed
    if _claimed is not None and jax.default_backend() != "cpu":
        logger.info("JAX's device memory pool: %g of each device (gpu_memory_utilization), set as "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION", _claimed)
    _claimed = None


def device_bytes_in_use() -> int:
    """Bytes device 0's allocator holds now (0 where it keeps no statistics: the CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0)


def create_pools(c, mc, dcfg, par, pages_per_seq: int, max_model_len: int, dtype, own_bytes: int = 0,
                 logit_rows: int = 0):
    """The target's KV pool and the drafter's (``dcfg``; None: no drafter) over the same
    page ids: (kv, dkv or None, num_pages), with ``c.num_pages`` pages or as many as fit
    (``pages_from_memory``; ``own_bytes``: the engine's weights on the device;
    ``logit_rows``: the most logit rows a step computes).

    A pool sized from memory is allocated here and waited for, so that a failure shows now,
    not at the first step. Its arrays (K and V of each layer) are separate blocks of XLA's
    allocator, and on a heap that grew in pieces (XLA_PYTHON_CLIENT_PREALLOCATE=false) the
    last one can find no free block of its size although the bytes are free: on the H200 the
    embedded family's 16 arrays of 5.9 GB, the 16th failed with 16 GB free and 5.4 GB its
    largest block, and surfaced as an out-of-memory error in the first step. Each failure
    gives back 5% of the pages, down to one sequence's."""
    # every host of a multi-host engine holds the same pool: the fewest pages any host's memory fits
    num_pages = c.num_pages or agree_min(pages_from_memory(c, mc, dcfg, par, pages_per_seq, own_bytes, logit_rows))
    if num_pages < pages_per_seq:
        raise ValueError(f"num_pages={num_pages} x page_size={c.page_size} cannot hold one sequence of "
                         f"max_model_len={max_model_len}: need at least {pages_per_seq} pages")
    if c.num_pages:
        return (*_allocate(c, mc, dcfg, par, num_pages, dtype), num_pages)
    while True:
        try:  # an allocation can fail at once or, asynchronously, in the wait
            pools = _allocate(c, mc, dcfg, par, num_pages, dtype)
            jax.block_until_ready(pools)
            return (*pools, num_pages)
        except jax.errors.JaxRuntimeError as e:
            pools = None  # the arrays that were allocated go back before the next try
            fewer = num_pages * 19 // 20
            if "RESOURCE_EXHAUSTED" not in str(e) or fewer < pages_per_seq:
                raise
            if jax.process_count() > 1:  # the hosts' pools would differ: each host's error says to lower it
                raise ValueError(f"nnodes={jax.process_count()}: the KV pool of {num_pages} pages did not fit "
                                 f"on this host; lower gpu_memory_utilization or set num_pages") from e
            logger.warning("KV page pool of %d pages did not fit in the device's free blocks; trying %d",
                           num_pages, fewer)
            num_pages = fewer


def _allocate(c, mc, dcfg, par, num_pages: int, dtype):
    """(kv, dkv or None): the target's pool and the drafter's of ``num_pages`` pages."""
    kv = KVCache.create(mc.num_layers, num_pages, c.page_size, mc.num_kv_heads, mc.head_dim,
                        kv_cache_dtype(c, dtype), par.kv_sharding(mc.num_kv_heads))
    if dcfg is None:
        return kv, None
    from jspec.drafters.registry import make_drafter

    sharding = par.kv_sharding(dcfg.num_kv_heads, draft=True)
    return kv, make_drafter(dcfg).create_cache(num_pages, c.page_size, dtype, sharding)


def pages_from_memory(c, mc, dcfg, par, pages_per_seq: int, own_bytes: int = 0, logit_rows: int = 0) -> int:
    """Pages that fit the engine's share of device 0 (``c``: the EngineConfig, ``mc``: the
    target's ModelConfig, ``dcfg``: the drafter's config or None, ``par``: the engine's
    parallel.EngineMesh, ``own_bytes``: what the engine holds already, its weights): as in
    vLLM, ``c.gpu_memory_utilization`` of the whole device (JAX's pool over its share) is the
    engine's, its weights, the KV cache and TEMP_RESERVE of it for XLA's temporaries, or
    LOGIT_COPIES f32 arrays of ``logit_rows`` x the vocabulary where that is more; the
    pool's free bytes cap it (other engines of the process hold theirs). On the CPU, or
    without memory stats, what max_num_seqs full sequences need."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit or jax.default_backend() == "cpu":
        return c.max_num_seqs * pages_per_seq
    dtype = resolve_dtype(c.dtype)
    itemsize = np.dtype(dtype).itemsize
    # K and V of every target layer (in its kv_cache_dtype), and of every drafter layer (its
    # own cache over the same page ids, the model's dtype) when speculating; per device (tensor
    # parallel: kv_heads / tp where sharded). (The n-gram method has no layers; its 4-byte
    # token per slot is left out.)
    layers = [(mc.num_layers, par.local_kv_heads(mc.num_kv_heads), mc.head_dim,
               np.dtype(kv_cache_dtype(c, dtype)).itemsize)]
    if dcfg is not None:
        layers.append((dcfg.num_layers, par.local_kv_heads(dcfg.num_kv_heads, draft=True), dcfg.head_dim, itemsize))
    page_bytes = sum(2 * n * c.page_size * kvh * d * size for n, kvh, d, size in layers)
    fraction = envs.XLA_PYTHON_CLIENT_MEM_FRACTION  # the pool's share of the device (None: no pool)
    share = c.gpu_memory_utilization * (limit / fraction if fraction else limit)
    reserve = max(share * TEMP_RESERVE, LOGIT_COPIES * logit_rows * mc.vocab_size * 4)
    free = min(share - reserve - own_bytes, limit - reserve - stats.get("bytes_in_use", 0))
    return max(pages_per_seq, int(free // page_bytes))
