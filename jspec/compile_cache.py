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
_enabled = False  # enable() ran with the cache on: the runner also keeps whole executables (engine/executables.py)


def enabled() -> bool:
    return _enabled


def enable() -> str | None:
    """Point jax's persistent compilation cache at $JSPEC_CACHE/xla unless the user set one
    or turned it off; returns the folder in use (None: off)."""
    global _enabled
    if not envs.JSPEC_COMPILATION_CACHE:
        return None
    _enabled = True
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = os.path.join(envs.JSPEC_CACHE, "xla")
    max_gb = envs.JSPEC_COMPILATION_CACHE_MAX_GB
    jax.config.update("jax_compilation_cache_max_size", int(max_gb * 2**30) if max_gb > 0 else -1)
    if max_gb > 0:
        backfill_access_times(path)
    cc.set_cache_dir(path)  # jax opens the folder at the next compilation, even after earlier ones
    logger.info("compiled steps are cached in %s (JSPEC_COMPILATION_CACHE=0: off)", path)
    return path


def backfill_access_times(path: str) -> int:
    """Give each entry of a jax cache folder that lacks an access-time file one (its
    modification time); returns how many. With a size limit, jax's LRU cache reads the
    access time of every entry before it writes a new one, and one missing file makes every
    write fail (a warning per compilation, nothing cached again). Entries lack one when they
    were written with no limit (JSPEC_COMPILATION_CACHE_MAX_GB <= 0: jax keeps no access
    times) or by a process killed between its two writes. File names: jax's lru_cache."""
    try:
        names = set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    fixed = 0
    for name in names:
        if not name.endswith("-cache") or name[: -len("-cache")] + "-atime" in names:
            continue
        try:
            mtime = os.stat(os.path.join(path, name)).st_mtime_ns
            with open(os.path.join(path, name[: -len("-cache")] + "-atime"), "wb") as f:
                f.write(mtime.to_bytes(8, "little"))
            fixed += 1
        except OSError as e:  # a read-only or concurrently pruned folder: jax's own warning follows
            logger.debug("compilation cache: no access time for %s (%s)", name, e)
    if fixed:
        logger.info("compilation cache: %d entries in %s had no access time; given their modification time",
                    fixed, path)
    return fixed
