"""One gpt-oss mixture-of-experts layer with its experts in MXFP4 (random, packed as shipped)
on the GPU, the expert part of ops.moe three ways, GPU time (the profiler's) per layer call,
rotating over 4 layers' weights (so nothing is served from L2):

  kernel   the GPU plan: kernels_pallas/moe_experts_mxfp4.py, the experts streamed packed
           and dequantized in the kernel (up to ops_moe.MXFP4_KERNEL_MAX_FRACTION * E pairs);
           then the kernels alone on each of their paths (CUDA cores, tensor cores: use_mma);
  xla      the XLA plan: each pair's expert gathered packed, dequantized, applied (at most E
           pairs; above, every expert dequantized densely);
  bf16     the same experts held in bf16 (dequantized once, 3.8x the bytes), the XLA plan;

beside the bound: the bytes of the experts the pairs touch, packed (4.25 bits a weight, with
their biases), over the bandwidth probe of the same run.

    PYTHONPATH=.:scripts python3 scripts/bench_moe_mxfp4.py --shape 20b --tokens 1,4,8,32
    PYTHONPATH=.:scripts python3 scripts/bench_moe_mxfp4.py --tiles 32,8,4,2 16,8,4,3 64,4,4,2

--tiles: the kernel alone at each (block_f, block_g, num_warps, num_stages) (one token, top-4),
for kernels_pallas/tuning.py's ``moe_mxfp4`` row; a fifth field ``mma`` takes the tensor-core
path (``moe_mxfp4_mma``: block_f at least 16), at each of --tokens:

    PYTHONPATH=.:scripts python3 scripts/bench_moe_mxfp4.py --tiles 32,8,2,3,mma 16,8,1,3,mma --tokens 1,4
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from bench_common import _probe_time, measure_bandwidth

from jspec import ops
from jspec.kernel_backend import GPU
from jspec.mxfp4 import dummy
from kernels_pallas import moe_experts_mxfp4 as mx

SHAPES = {"20b": (32, 2880, 2880, 4), "120b": (128, 2880, 2880, 4), "tiny": (8, 64, 96, 2)}  # E, I, H, top_k
LAYERS = 4


def layer_weights(E, I, H, seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    gu, dn = dummy(k[0], (E, 2 * I, H), "bfloat16"), dummy(k[1], (E, H, I), "bfloat16")
    router = (0.02 * jax.random.normal(k[2], (E, H))).astype(jnp.bfloat16)
    biases = dict(b_router=jnp.zeros((E,), jnp.bfloat16), b_gate_up=jnp.zeros((E, 2 * I), jnp.bfloat16),
                  b_down=jnp.zeros((E, H), jnp.bfloat16))
    return router, gu, dn, biases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="20b")
    ap.add_argument("--tokens", default="1,4,8,32")
    ap.add_argument("--tiles", nargs="*", default=None)
    args = ap.parse_args(argv)
    E, I, H, K = SHAPES[args.shape]
    tiny = args.shape == "tiny"
    bw = measure_bandwidth(tiny)["best_TBps"] * 1e12
    layers = [layer_weights(E, I, H, s) for s in range(LAYERS)]
    expert_bytes = sum(a.nbytes for a in jax.tree.leaves((layers[0][1], layers[0][2]))) / E + (3 * I + H) * 2
    interpret = jax.default_backend() != "gpu"
    plans = {"kernel": ops.KernelPlan(linear=GPU(interpret=interpret)), "xla": ops.KernelPlan()}
    print(f"gpt-oss {args.shape} MoE layer: {E} experts, I {I}, H {H}, top {K}; {expert_bytes / 1e6:.2f} MB an "
          f"expert packed; probe {bw / 1e12:.2f} TB/s", flush=True)

    def probe(f, sets):  # seconds a call, compiled before the probe
        jax.block_until_ready(f(*sets[0]))
        return _probe_time(f, sets)

    def kernels_alone(x, experts, **kw):  # mx.moe_experts_mxfp4_gpu without ops.moe's router and combine
        f = jax.jit(lambda x, gu, dn, b: mx.moe_experts_mxfp4_gpu(
            x, experts, gu.blocks, gu.scales, dn.blocks, dn.scales, b["b_gate_up"], b["b_down"], top_k=K, limit=7.0,
            interpret=interpret, **kw))
        return probe(f, [(x, gu, dn, b) for _, gu, dn, b in layers])

    if args.tiles:
        for N in (int(t) for t in args.tokens.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(7), (N, H), jnp.bfloat16)
            experts = (jnp.arange(N * K, dtype=jnp.int32) * 7) % E  # distinct experts while N K <= E
            bound = min(E, N * K) * expert_bytes / bw
            for t in args.tiles:
                fields = t.split(",")
                mma = fields[4:] == ["mma"]
                blocks = tuple(int(v) for v in fields[:4])
                s = kernels_alone(x, experts, blocks=blocks, mma=mma)
                print(f"tokens {N:3d} tiles {blocks}{' mma' if mma else ''}: {s * 1e6:8.1f} us, bound "
                      f"{bound * 1e6:.1f} us -> {bound / s:5.1%}", flush=True)
        return

    for N in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(N), (N, H), jnp.bfloat16)
        touched = min(E, N * K)  # at most every expert once (random routing spreads the pairs)
        bound = touched * expert_bytes / bw
        row = []
        for name in ("kernel", "xla", "bf16"):
            sets = [(x, r, gu, dn, b) for r, gu, dn, b in layers]
            if name == "bf16":  # the experts held in bf16: dequantized before the timed calls
                sets = [(x, r, gu.dequantize(), dn.dequantize(), b) for r, gu, dn, b in layers]
            f = jax.jit(lambda x, r, gu, dn, b, plan=plans["xla" if name == "bf16" else name]: ops.moe(
                plan, x, r, gu, dn, top_k=K, norm_topk_prob=True, swiglu_limit=7.0, **b))
            s = probe(f, sets)
            row.append(f"{name} {s * 1e6:8.1f} us ({bound / s:5.1%})")
        experts = jax.random.randint(jax.random.PRNGKey(N + 1), (N * K,), 0, E, jnp.int32)
        for mma in (False, True):  # the kernels alone, each path (the plan takes mx.use_mma's)
            row.append(f"{'tensor' if mma else 'CUDA'}-core path {kernels_alone(x, experts, mma=mma) * 1e6:8.1f} us")
        print(f"tokens {N:3d} ({N * K:3d} pairs, {touched} experts, bound {bound * 1e6:.1f} us): " + ", ".join(row),
              flush=True)


if __name__ == "__main__":
    main()
