"""jspec/engine/executables.py's Store across processes of different environments on one host
(one per GPU differs in JAX_LOCAL_DEVICE_IDS): each keeps its own folder, the size limit is
held over all of them least recently used first, and a file removed by another process
between the load and its use stamp is still a load, not an error."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine.executables import Store


def _compiled(n):
    return jax.jit(lambda x: x * n + 1).lower(jnp.zeros((4,), jnp.float32)).compile()


def _store(root, env, max_gb=1.0):
    s = Store(str(root), max_gb)
    s.folder = os.path.join(str(root), env)  # another process's environment
    return s


def test_environments_coexist_and_share_one_size_limit(tmp_path):
    a, b = _store(tmp_path, "env_a"), _store(tmp_path, "env_b")
    a.save("k1", _compiled(2))
    b.save("k1", _compiled(3))
    # b's first save no longer removes a's folder: a still loads its own program
    x = jnp.arange(4, dtype=jnp.float32)
    np.testing.assert_array_equal(a.load("k1")(x), x * 2 + 1)
    np.testing.assert_array_equal(b.load("k1")(x), x * 3 + 1)
    size = os.path.getsize(os.path.join(tmp_path, "env_a", "k1.exe"))
    # a limit of about two entries: a's oldest goes when b keeps a third entry
    os.utime(os.path.join(tmp_path, "env_a", "k1.exe"), (1, 1))
    b.max_bytes = int(2.5 * size)
    b.save("k2", _compiled(4))
    assert not os.path.exists(os.path.join(tmp_path, "env_a"))  # emptied, then removed
    assert sorted(os.listdir(os.path.join(tmp_path, "env_b"))) == ["k1.exe", "k2.exe"]


def test_a_file_removed_after_its_read_still_loads(tmp_path, monkeypatch):
    s = _store(tmp_path, "env_a")
    s.save("k", _compiled(2))
    real = os.utime

    def gone(path, *a, **kw):  # another process's size limit removed it after our read
        os.remove(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "utime", gone)
    x = jnp.arange(4, dtype=jnp.float32)
    np.testing.assert_array_equal(s.load("k")(x), x * 2 + 1)
    assert s.load("k") is None  # gone now: the caller compiles
