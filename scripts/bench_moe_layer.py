"""One Qwen3-30B-A3B mixture-of-experts layer (128 experts of 768, 8 a token, hidden 2048,
bf16) on the GPU: jspec's ops.moe against two other ways to run it, wall time per layer
over a chain of 8 layers' weights (rotated, so nothing is served from L2):

  gather  each (token, expert) pair's weights gathered, then applied (what ops.moe does at
          up to E pairs);
  dense   every expert for every token, weighted by the router (zero off the top k).

    PYTHONPATH=. python3 scripts/bench_moe_layer.py

A row's "chosen-expert bytes": min(pairs, E) experts' weights (the bytes of the pairs, at
most every expert once).
Raw results: docs/bench/2026-11-27_moe_layer.log.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import ops

E, I, H, K = 128, 768, 2048, 8
LAYERS = 8
PLAN = ops.KernelPlan()


def _route(x, w_router):
    probs = jax.nn.softmax((x @ w_router.T).astype(jnp.float32), -1)
    w, e = jax.lax.top_k(probs, K)
    return w / w.sum(-1, keepdims=True), e


def gather(x, w_router, w_gu, w_dn):
    w, e = _route(x, w_router)
    h = jnp.einsum("mh,mih->mi", jnp.repeat(x, K, axis=0), w_gu[e.reshape(-1)])
    a, b = jnp.split(h, 2, -1)
    y = jnp.einsum("mi,mhi->mh", jax.nn.silu(a) * b, w_dn[e.reshape(-1)])
    return (y.reshape(x.shape[0], K, H) * w.astype(x.dtype)[..., None]).sum(1)


def dense(x, w_router, w_gu, w_dn):
    w, e = _route(x, w_router)
    full = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], e].set(w).astype(x.dtype)
    a, b = jnp.split(jnp.einsum("nh,eih->nei", x, w_gu), 2, -1)
    y = jnp.einsum("nei,ehi->neh", jax.nn.silu(a) * b, w_dn)
    return (y * full[..., None]).sum(1)


def jspec_moe(x, w_router, w_gu, w_dn):
    return ops.moe(PLAN, x, w_router, w_gu, w_dn, top_k=K, norm_topk_prob=True)


def chain(fn):
    @jax.jit
    def run(x, routers, gus, dns):
        for i in range(LAYERS):
            x = x + fn(x, routers[i], gus[i], dns[i]) * 0.01
        return x
    return run


def main():
    key = jax.random.PRNGKey(0)
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02  # noqa: E731
    gus = [normal(i, (E, 2 * I, H)) for i in range(LAYERS)]
    dns = [normal(100 + i, (E, H, I)) for i in range(LAYERS)]
    routers = [normal(200 + i, (E, H)) for i in range(LAYERS)]
    for N in (1, 4, 8, 16, 32, 64, 256):
        x = jax.random.normal(key, (N, H), jnp.bfloat16)
        res = {}
        for name, fn in (("ops.moe", jspec_moe), ("gather", gather), ("dense", dense)):
            if name == "gather" and N * K > 4 * E:  # its copies would be 4 layers of experts
                continue
            f = chain(fn)
            res[name] = f(x, routers, gus, dns).block_until_ready()
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                f(x, routers, gus, dns).block_until_ready()
                ts.append(time.perf_counter() - t)
            ms = np.median(ts) * 1e3 / LAYERS
            nbytes = min(N * K, E) * 3 * I * H * 2
            print(f"N={N:3d} {name:7s}: {ms:.3f} ms/layer; chosen-expert bytes {nbytes / 1e6:.1f} MB -> "
                  f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s", flush=True)
        d = float(jnp.max(jnp.abs(res["ops.moe"].astype(jnp.float32) - res["dense"].astype(jnp.float32))))
        print(f"N={N}: max |ops.moe - dense| {d:.2e}", flush=True)


if __name__ == "__main__":
    main()
