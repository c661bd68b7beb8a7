"""Compiled steps kept on disk whole (jax's serialize_executable), so that a process starting
again with the same code, model, configuration and devices loads its step programs instead
of tracing, lowering and compiling them. jax's persistent compilation cache
(jspec/compile_cache.py) skips XLA's compiler only: an 8B step still took ~0.8 s to trace
and lower on the H200 (31 shapes: 25 of a warm server start's 40 s).

An entry is loaded only under the key of everything its trace reads (``Store.key``):
  the environment: jspec's and kernels_pallas' source files, jax's and the platform's
    versions, the devices, jax's configuration, the XLA_ / JAX_ / JSPEC_ / LIBTPU_ variables;
  the runner's trace-time state (``context``: its configs, kernel plan, modules, sampling
    settings, as stable reprs);
  the call: the jitted function's name, its static arguments and the abstract value of each
    argument (pytree structure, shapes, dtypes, shardings and their devices).
The whole store, every environment's folder, is held under JSPEC_COMPILATION_CACHE_MAX_GB,
least recently used first: another environment is not removed on sight, since it may be
another process's on this host now (one per GPU differs in JAX_LOCAL_DEVICE_IDS; removing
each other's folders made a tp 2 run with a process per GPU fail on a vanished file), and one
the code left behind ages out.
A step compiled while jax's persistent cache holds it is not kept here (``compile_and_keep``):
such a process loads it from jax's cache, as before. Nor is one the platform cannot serialize
(XLA:CPU: the top-k / top-p variants, "`LessThan` is not serializable"), which jax's cache
still holds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import sys
import threading
import time

import jax
import numpy as np

from jspec import envs

logger = logging.getLogger("jspec.engine")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a function's or object's repr: differs per process


def stable_repr(obj) -> str:
    """repr without memory addresses (functions in a registry entry, ...)."""
    return _ADDRESS.sub("", repr(obj))


@functools.cache
def environment_digest() -> str:
    """What every trace of this process reads besides its own inputs (module docstring)."""
    h = hashlib.sha256()
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # jspec/
    roots.append(os.path.join(os.path.dirname(roots[0]), "kernels_pallas"))
    for root in roots:
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + hashlib.sha256(f.read()).digest())
    import jaxlib

    devices = jax.devices()
    h.update(stable_repr((sys.version_info[:2], jax.__version__, jaxlib.__version__, jax.default_backend(),
                          devices[0].client.platform_version, [(d.id, d.device_kind) for d in devices])).encode())
    config = {k: v for k, v in jax.config.values.items() if isinstance(v, (str, int, float, bool, type(None)))}
    h.update(stable_repr(sorted(config.items())).encode())
    h.update(repr(envs.compiler_environment()).encode())
    return h.hexdigest()[:24]


def executable_device_ids(compiled) -> list[int]:
    """The ids of the devices ``compiled`` runs on in this process, in its device order."""
    return [d.id for d in compiled.runtime_executable().local_devices()]


def _abstract(x):
    if isinstance(x, jax.Array):
        return (x.shape, str(x.dtype), stable_repr(x.sharding), tuple(sorted(d.id for d in x.sharding.device_set)))
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, str(x.dtype))
    return stable_repr(x)


class Store:
    """A folder of serialized step executables: ``$JSPEC_CACHE/executables/<environment>``."""

    def __init__(self, root: str, max_gb: float):
        self.root = root
        self.folder = os.path.join(root, environment_digest())
        self.max_bytes = int(max_gb * 2**30) if max_gb > 0 else None
        self._pending: list = []  # (key, executable) compiled, not yet written (``keep``, ``flush``)
        self._lock = threading.Lock()

    @classmethod
    def open(cls) -> Store | None:
        """The store when jspec's compilation cache is on (``compile_cache.enable`` ran in
        this process, as jspec.LLM and the server do), else None."""
        from jspec import compile_cache

        if not compile_cache.enabled():  # (enable() turns it on only when JSPEC_COMPILATION_CACHE is)
            return None
        return cls(os.path.join(envs.JSPEC_CACHE, "executables"), envs.JSPEC_COMPILATION_CACHE_MAX_GB)

    def key(self, context: str, name: str, args, static: dict) -> str:
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda x: x is None)
        sig = (context, name, sorted(static.items()), stable_repr(tree), [_abstract(x) for x in leaves])
        return hashlib.sha256(stable_repr(sig).encode()).hexdigest()[:32]

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key + ".exe")

    def load(self, key: str):
        """The executable stored under ``key`` (a ``jax.stages.Compiled``), or None."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree, ids = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            # its own devices, in its order: jax's default, every device of the backend, makes a
            # one-device step of a 4-GPU host expect 4 shards of each argument
            compiled = deserialize_and_load(blob, in_tree, out_tree, execution_devices=[by_id[i] for i in ids])
        except FileNotFoundError:
            return None
        except Exception as e:  # a truncated or foreign file: compile instead, and replace it
            logger.warning("compiled step %s could not be loaded (%s: %s); compiling it again", path,
                           type(e).__name__, e)
            return None
        try:
            os.utime(path)  # its last use, for the size limit
        except OSError:  # removed by another process's size limit meanwhile: loaded all the same
            pass
        return compiled

    def keep(self, key: str, compiled) -> None:
        """``compiled`` to be written under ``key`` by ``flush``: serializing an executable
        holds the host for a moment (~0.4 s of a cold 8B step's start on the H200, each),
        which warmup's compilations should not wait for."""
        with self._lock:
            self._pending.append((key, compiled))

    def flush(self):
        """Write what ``keep`` holds."""
        with self._lock:
            pending, self._pending = self._pending, []
        t = time.monotonic()
        for key, compiled in pending:
            self.save(key, compiled)
        if pending:
            logger.info("kept %d compiled steps in %s (%.1f s)", len(pending), self.folder, time.monotonic() - t)

    def save(self, key: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            blob = pickle.dumps((*serialize(compiled), executable_device_ids(compiled)))
        except Exception as e:  # an executable the platform cannot serialize: nothing kept
            logger.debug("compiled step not kept (%s: %s)", type(e).__name__, e)
            return
        os.makedirs(self.folder, exist_ok=True)
        tmp = f"{self._path(key)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, self._path(key))  # whole or not at all, for another process reading it
        self._limit_size()

    def _limit_size(self):
        """Every environment's entries under max_bytes, the least recently used removed first;
        a folder left empty goes too."""
        if self.max_bytes is None:
            return
        entries, folders = [], []
        for env in os.listdir(self.root):
            folder = os.path.join(self.root, env)
            if not os.path.isdir(folder):
                continue
            folders.append(folder)
            for name in os.listdir(folder):
                try:
                    st = os.stat(os.path.join(folder, name))
                except FileNotFoundError:  # another process removed or replaced it meanwhile
                    continue
                entries.append((st.st_mtime, st.st_size, os.path.join(folder, name)))
        total = sum(e[1] for e in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            _remove(path)
            total -= size
        for folder in folders:
            if folder != self.folder:
                try:
                    os.rmdir(folder)  # only when empty
                except OSError:
                    pass


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


_compiling = threading.local()  # .hit: jax's persistent cache answered this thread's compile
_listening = False


def _on_event(event: str, **_kw):
    if event == "/jax/compilation_cache/cache_hits" and getattr(_compiling, "active", False):
        _compiling.hit = True  # jax records it on the thread that compiles


def compile_and_keep(store: Store | None, key: str | None, lowered, options: dict | None = None):
    """``lowered`` compiled (with XLA ``options`` added to its jitted function's), and kept in
    ``store`` under ``key`` (``Store.keep``), unless jax's persistent
    cache answered the compile: an executable loaded from jax's cache is not serialized
    again (on XLA:CPU such a copy fails to run: "Function ... not found", jax 0.10.2)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    t = time.monotonic()
    _compiling.active, _compiling.hit = True, False
    try:
        compiled = lowered.compile(options)
    finally:
        _compiling.active = False
    if store is not None and key is not None and not _compiling.hit:
        store.keep(key, compiled)
    logger.debug("compiled a step in %.1f s", time.monotonic() - t)
    return compiled
