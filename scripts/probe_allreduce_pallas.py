"""Probe (issue 59; not adopted, kept in git history: docs/benchmarks.md "Tensor parallelism"): one-shot all-reduce of decode-sized messages as a Pallas Mosaic GPU
kernel over NVLink peer memory, ONE process driving every local GPU (jspec's default tp),
against lax.psum (NCCL). No multimem / multicast: the kernel uses remote_ref only, and the
lowered custom call is checked to carry no multimem_parameters before anything runs."""
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AX = "x"


def pull_sum(x, *, n, G=1):
    R, C = x.shape
    cw = C // G

    def kernel(x_ref, o_ref, sem):
        dev = lax.axis_index(AX)
        b = lax.axis_index("b")
        cols = pl.ds(b * cw, cw)
        for d in range(1, n):
            pl.semaphore_signal(sem.at[b], device_id=lax.rem(dev + d, n))
        pl.semaphore_wait(sem.at[b], n - 1)
        acc = x_ref[:, cols].astype(jnp.float32)
        for d in range(1, n):
            acc = acc + plgpu.remote_ref(x_ref, lax.rem(dev + d, n))[:, cols].astype(jnp.float32)
        o_ref[:, cols] = acc.astype(o_ref.dtype)
        for d in range(1, n):
            pl.semaphore_signal(sem.at[b], device_id=lax.rem(dev + d, n))
        pl.semaphore_wait(sem.at[b], n - 1)

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((R, C), x.dtype),
                        scratch_types=[plgpu.SemaphoreType.REGULAR((G,))], grid=(G,), grid_names=("b",))(x)


def push_sum(x, *, n, G=1):
    R, C = x.shape
    cw = C // G

    def kernel(x_ref, o_ref, recv_ref, ready, done):
        dev = lax.axis_index(AX)
        b = lax.axis_index("b")
        cols = pl.ds(b * cw, cw)
        # every peer inside this kernel: its recv buffer is ours to write now
        for d in range(1, n):
            pl.semaphore_signal(ready.at[b], device_id=lax.rem(dev + d, n))
        pl.semaphore_wait(ready.at[b], n - 1)
        mine = x_ref[:, cols]
        for d in range(1, n):
            plgpu.remote_ref(recv_ref, lax.rem(dev + d, n)).at[dev][:, cols] = mine
        for d in range(1, n):
            pl.semaphore_signal(done.at[b], device_id=lax.rem(dev + d, n))
        pl.semaphore_wait(done.at[b], n - 1)
        acc = mine.astype(jnp.float32)
        for d in range(1, n):
            acc = acc + recv_ref.at[lax.rem(dev + d, n)][:, cols].astype(jnp.float32)
        o_ref[:, cols] = acc.astype(o_ref.dtype)

    out, _ = plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((R, C), x.dtype), jax.ShapeDtypeStruct((n, R, C), x.dtype)),
                          scratch_types=[plgpu.SemaphoreType.REGULAR((G,)), plgpu.SemaphoreType.REGULAR((G,))],
                          grid=(G,), grid_names=("b",))(x)
    return out


def psum(v):
    return lax.psum(v.astype(jnp.float32), AX).astype(v.dtype)


def main():
    n = jax.device_count()
    assert jax.process_count() == 1
    mesh = jax.make_mesh((n,), (AX,))
    sh = NamedSharding(mesh, P(AX))
    sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
    print(jax.devices(), "XLA_FLAGS", os.environ.get("XLA_FLAGS"), flush=True)
    cases = [(1, 4096, jnp.bfloat16), (1, 4096, jnp.float32), (8, 4096, jnp.float32), (32, 4096, jnp.float32), (32, 4096, jnp.bfloat16), (1, 8192, jnp.float32)]
    kernels = {"pull1": functools.partial(pull_sum, n=n, G=1), "push1": functools.partial(push_sum, n=n, G=1),
               "push8": functools.partial(push_sum, n=n, G=8), "push16": functools.partial(push_sum, n=n, G=16)}
    # no multimem anywhere (multicast is forbidden on these hosts)
    for name, k in kernels.items():
        txt = sm(k).lower(jax.ShapeDtypeStruct((n, 4096), jnp.float32, sharding=sh)).as_text()
        assert "multimem" not in txt, name
    print("lowered: no multimem", flush=True)
    for R, C, dt in cases:
        x = jax.device_put(jnp.asarray(np.random.default_rng(R).standard_normal((n * R, C)), dt), sh)
        want = np.asarray(sm(psum)(x)).astype(np.float32)
        res = {}
        for name, fn in [("psum", psum)] + list(kernels.items()):
            try:
                got = np.asarray(sm(fn)(x)).astype(np.float32)
                err = float(np.abs(got - want).max())

                def body(v, fn=fn):
                    for _ in range(64):
                        v = fn(v) * 0.5
                    return v
                f = sm(body)
                f(x).block_until_ready()
                ts = []
                for _ in range(30):
                    t = time.perf_counter()
                    f(x).block_until_ready()
                    ts.append(time.perf_counter() - t)
                res[name] = f"{np.median(ts) / 64 * 1e6:.1f} us (err {err:.2g})"
            except Exception as e:  # noqa
                res[name] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
        print(f"R={R} C={C} {np.dtype(dt).name}: " + "; ".join(f"{k} {v}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
