"""jspec/engine/executables.py's Store on a host with more devices than a step uses: a stored
step loads onto its own devices, in its order. jax's default (every device of the backend)
made a tp 1 step stored on a 4 x H200 host expect 4 shards of each argument when loaded
again (2026-11-30, scripts/tp_check.py after another run had filled the store)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.engine.executables import Store


def test_steps_load_onto_their_own_devices(tmp_path):
    devs = jax.devices()
    one = jax.device_put(jnp.arange(8.0), devs[0])
    mesh = Mesh(np.array([devs[3], devs[2]]), ("tp",))  # not in id order: the mesh's order counts
    two = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(lambda x: x * 2 + 1)
    g = jax.jit(lambda x: (x * 3).sum(1), out_shardings=NamedSharding(mesh, P()))
    Store(str(tmp_path), 1.0).save("one", f.lower(one).compile())
    Store(str(tmp_path), 1.0).save("two", g.lower(two).compile())
    fresh = Store(str(tmp_path), 1.0)  # another process's start: what it finds on disk
    np.testing.assert_array_equal(fresh.load("one")(one), np.arange(8.0) * 2 + 1)
    out = fresh.load("two")(two)
    np.testing.assert_array_equal(out, (np.arange(32.0).reshape(4, 8) * 3).sum(1))
    assert {d.id for d in out.sharding.device_set} == {2, 3}
