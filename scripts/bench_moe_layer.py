"""One Qwen3-30B-A3B mixture-of-experts layer (128 experts of 768, 8 a token, hidden 2048,
bf16) on the GPU: jspec's ops.moe against other ways to run it, wall time per layer over a
chain of 8 layers' weights (rotated, so nothing is served from L2):

  ops.moe      XLA's gather at up to E pairs, dense passes of 512 tokens above (c=C: of C);
  ops.moe gpu  with the GPU plan: kernels_pallas/moe_experts.py from E / 2 to E pairs
               ("tiles": the kernels at other tiles);
  gather       each (token, expert) pair's weights gathered, then applied (XLA fuses the
               gather into its reductions: --gpu-time);
  gather_reduce  the same written out as multiply-and-sum in f32;
  ragged       XLA's grouped GEMM (lax.ragged_dot_general) over the pairs sorted by expert;
  dense_fold   every expert for every token, the router weights folded into down's input
               (one contraction over expert and intermediate together).

    PYTHONPATH=. python3 scripts/bench_moe_layer.py [TOKENS, e.g. 1,8,16]
    PYTHONPATH=.:scripts python3 scripts/bench_moe_layer.py 1,16 --gpu-time

--gpu-time: XLA's gather and the kernels by the profiler's GPU time per layer (busy time and
the top kernels), not wall time: the chain's wall time also holds the gaps between its
launches.

A row's "chosen-expert bytes": min(pairs, E) experts' weights (the bytes of the pairs, at
most every expert once); "needed TFLOP/s": the chosen pairs' FLOPs over the time.
Raw results: docs/bench/2026-11-27_moe_layer*.log.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import ops
from kernels_pallas.moe_experts import moe_experts_gpu, ref_moe_experts

E, I, H, K = 128, 768, 2048, 8
LAYERS = 8
PLAN = ops.KernelPlan()


def _route(x, w_router):
    probs = jax.nn.softmax((x @ w_router.T).astype(jnp.float32), -1)
    w, e = jax.lax.top_k(probs, K)
    return w / w.sum(-1, keepdims=True), e


def _combine(y, w, x):
    """Each token's top-K pair rows y [N K, H], weighted by the router's w [N, K], summed."""
    return (y.reshape(x.shape[0], K, H) * w.astype(x.dtype)[..., None]).sum(1)


def gather(x, w_router, w_gu, w_dn):
    w, e = _route(x, w_router)
    return _combine(ref_moe_experts(x, e.reshape(-1), w_gu, w_dn, top_k=K), w, x)


def gather_reduce(x, w_router, w_gu, w_dn):
    """The gather written out as multiply-and-sum in f32: the form XLA's own fusion of the
    gather into its reductions takes (--gpu-time)."""
    w, e = _route(x, w_router)
    flat, f32 = e.reshape(-1), jnp.float32
    xs = jnp.repeat(x, K, axis=0).astype(f32)
    h = (w_gu[flat].astype(f32) * xs[:, None, :]).sum(-1).astype(x.dtype)
    a, b = jnp.split(h, 2, -1)
    act = (jax.nn.silu(a) * b).astype(f32)
    y = (w_dn[flat].astype(f32) * act[:, None, :]).sum(-1).astype(x.dtype)
    return _combine(y, w, x)


def ragged(x, w_router, w_gu, w_dn):
    w, e = _route(x, w_router)
    flat = e.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    a, b = jnp.split(jax.lax.ragged_dot_general(x[order // K], w_gu, sizes, dims), 2, -1)
    y = jax.lax.ragged_dot_general(jax.nn.silu(a) * b, w_dn, sizes, dims)[jnp.argsort(order)]
    return _combine(y, w, x)


def dense_fold(x, w_router, w_gu, w_dn):
    w, e = _route(x, w_router)
    full = jnp.zeros((x.shape[0], E), x.dtype).at[jnp.arange(x.shape[0])[:, None], e].set(w.astype(x.dtype))
    a, b = jnp.split(jnp.einsum("nh,eih->nei", x, w_gu), 2, -1)
    return jnp.einsum("nei,ehi->nh", jax.nn.silu(a) * b * full[..., None], w_dn)


def jspec_moe(chunk=ops.MOE_DENSE_CHUNK, plan=PLAN):
    return lambda x, w_router, w_gu, w_dn: ops.moe(plan, x, w_router, w_gu, w_dn, top_k=K, norm_topk_prob=True,
                                                   chunk=chunk)


def kernel_tiles(blocks):
    """The few-pair kernels with the given tiles (gate_up's, down's), combined as ops.moe does."""
    def fn(x, w_router, w_gu, w_dn):
        w, e = _route(x, w_router)
        return _combine(moe_experts_gpu(x, e.reshape(-1).astype(jnp.int32), w_gu, w_dn, top_k=K, blocks=blocks), w, x)
    return fn


# (block_f, block_d, num_warps, num_stages, mma) pairs tried at up to 16 tokens: gate_up's, down's.
# The first: the tensor-core tiles the kernels took by default until the narrow-weight rows of
# kernels_pallas/tuning.py (2026-11-27).
SWEEP = (((32, 256, 4, 6, True), (32, 256, 4, 6, True)),
         ((16, 256, 4, 6, True), (16, 256, 4, 6, True)), ((64, 256, 4, 4, True), (64, 256, 4, 4, True)),
         ((16, 512, 4, 4, True), (32, 256, 4, 6, True)), ((8, 512, 4, 4, False), (8, 256, 4, 4, False)))


def chain(fn):
    @jax.jit
    def run(x, routers, gus, dns):
        for i in range(LAYERS):
            x = x + fn(x, routers[i], gus[i], dns[i]) * 0.01
        return x
    return run


def gpu_time(tokens, x_of, routers, gus, dns):
    from gpu_trace import device_times

    for N in tokens:
        for name, fn in (("XLA gather", gather), ("moe_experts kernels", kernel_tiles(None))):
            t = device_times(chain(fn), [(x_of(N), routers, gus, dns)], reps=10)
            print(f"N={N:4d} {name}: GPU busy {t['busy_us'] / LAYERS:.1f} us/layer (union "
                  f"{t['union_us'] / LAYERS:.1f})", flush=True)
            for k, v in sorted(t["kernels_us"].items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {v / LAYERS:7.1f} us/layer  {k[:80]}", flush=True)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tokens = [int(n) for n in args[0].split(",")] if args else [1, 8, 16, 32, 64, 256, 512, 1024, 2048]
    key = jax.random.PRNGKey(0)
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02  # noqa: E731
    gus = [normal(i, (E, 2 * I, H)) for i in range(LAYERS)]
    dns = [normal(100 + i, (E, H, I)) for i in range(LAYERS)]
    routers = [normal(200 + i, (E, H)) for i in range(LAYERS)]
    if "--gpu-time" in sys.argv:
        return gpu_time(tokens, lambda n: jax.random.normal(key, (n, H), jnp.bfloat16), routers, gus, dns)
    for N in tokens:
        x = jax.random.normal(key, (N, H), jnp.bfloat16)
        res = {}
        ways = [("ops.moe", jspec_moe()), ("gather", gather), ("gather_reduce", gather_reduce),
                ("ragged", ragged), ("dense_fold", dense_fold)]
        ways += [(f"ops.moe c={c}", jspec_moe(c)) for c in (256, 1024, 2048) if c <= N]
        if N * K <= E:
            ways += [("ops.moe gpu", jspec_moe(plan=ops.KernelPlan(linear="gpu")))]
            ways += [(f"tiles {a[0]}x{a[1]}/{b[0]}x{b[1]}{'m' if a[4] else ''}", kernel_tiles((a, b))) for a, b in SWEEP]
        for name, fn in ways:
            if name.startswith("gather") and N * K > 4 * E:  # each pair re-reads its expert: 4+ layers' worth
                continue
            if name == "dense_fold" and N > 512:
                continue
            f = chain(fn)
            res[name] = f(x, routers, gus, dns).block_until_ready()
            ts = []
            for _ in range(10 if N >= 512 else 20):
                t = time.perf_counter()
                f(x, routers, gus, dns).block_until_ready()
                ts.append(time.perf_counter() - t)
            ms = np.median(ts) * 1e3 / LAYERS
            nbytes = min(N * K, E) * 3 * I * H * 2
            flops = N * K * 3 * I * H * 2
            print(f"N={N:4d} {name:16s}: {ms:.3f} ms/layer; chosen-expert bytes {nbytes / 1e6:.1f} MB -> "
                  f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s; needed {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)
        ref = res["ops.moe"].astype(jnp.float32)
        d = max(float(jnp.max(jnp.abs(v.astype(jnp.float32) - ref))) for v in res.values())
        print(f"N={N}: max |other - ops.moe| {d:.2e} over {len(res) - 1} others", flush=True)


if __name__ == "__main__":
    main()
