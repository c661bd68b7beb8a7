"""jax's persistent compilation cache, on by default for ``jspec.LLM`` and the server (as
vLLM keeps its compiled graphs under ~/.cache/vllm): a step shape compiled once, by warmup
or a first request, is loaded from disk by the next process on the same machine, jax
version and code instead of being compiled again (a server restart skips most of its
warmup). jax keys each entry by the program, the compile options and the device, so a
stale entry is never used. It holds at most JSPEC_COMPILATION_CACHE_MAX_GB (10 GiB by
default), the least recently used entries evicted first (jax's LRU cache). A cache the user
configured (JAX_COMPILATION_CACHE_DIR, jax.config) is left as it is;
JSPEC_COMPILATION_CACHE=0 turns it off.
"""

from __future__ import annotations

import logging
import os

import jax

from jspec import envs

logger = logging.getLogger("jspec")


def enable() -> str | None:
    """Point jax's persistent compilation cache at $JSPEC_CACHE/xla unless the user set one
    or turned it off; returns the folder in use (None: off)."""
    if not envs.JSPEC_COMPILATION_CACHE:
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = os.path.join(envs.JSPEC_CACHE, "xla")
    max_gb = envs.JSPEC_COMPILATION_CACHE_MAX_GB
    jax.config.update("jax_compilation_cache_max_size", int(max_gb * 2**30) if max_gb > 0 else -1)
    cc.set_cache_dir(path)  # jax opens the folder at the next compilation, even after earlier ones
    logger.info("compiled steps are cached in %s (JSPEC_COMPILATION_CACHE=0: off)", path)
    return path
