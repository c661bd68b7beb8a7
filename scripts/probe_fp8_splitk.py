"""Split-K probe for FP8 one-row projections (issue 60; an experiment kept in git history): GPU time of the
kernel vs a split-K stream (grid F/bf x S, f32 partials [S, F]) + XLA's epilogue (sum, scale, round, residual).
    PYTHONPATH=.:scripts python3 scripts/probe_fp8_splitk.py  (H200; $OUT/splitk.json)"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from gpu_trace import device_times, time_tilings
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jspec.quantization import quantize_fp8
from kernels_pallas.fused_linear import fused_linear_gpu, ref_fused_linear, stream_rows


def splitk_kernel(x_ref, w_ref, o_ref, *, Ks, block_d, mma):
    (y,) = stream_rows(x_ref, [w_ref], None, prologue="none", K=Ks, block_d=block_d, eps=0.0, mma=mma)
    o_ref[0, :] = y

def splitk(x, w, scale, res, *, S, bf, bd, warps, stages, mma):
    F, K = w.shape
    Ks = K // S
    part = pl.pallas_call(
        functools.partial(splitk_kernel, Ks=Ks, block_d=bd, mma=mma),
        grid=(F // bf, S),
        in_specs=[pl.BlockSpec((1, Ks), lambda i, s: (0, s)), pl.BlockSpec((bf, Ks), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((1, bf), lambda i, s: (s, i)),
        out_shape=jax.ShapeDtypeStruct((S, F), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, w)
    y = (jnp.sum(part, 0, keepdims=True) * scale).astype(x.dtype)
    return y if res is None else (res.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)

out = []
for name, F, K, residual in [("qkv", 6144, 4096, False), ("o", 4096, 4096, True), ("down", 4096, 14336, True)]:
    keys = jax.random.split(jax.random.PRNGKey(F + K), 8)
    x = jax.random.normal(keys[0], (1, K), jnp.float32).astype(jnp.bfloat16)
    ws = [quantize_fp8((0.02 * jax.random.normal(keys[1 + i], (F, K), jnp.float32)).astype(jnp.bfloat16), None, "bfloat16") for i in range(4)]
    res = jax.random.normal(keys[6], (1, F), jnp.float32).astype(jnp.bfloat16) if residual else None
    args = [(x, w.w, w.scale.reshape(-1)) for w in ws]
    base = jax.jit(lambda x, w, s: fused_linear_gpu(x, w, None, None, res, w_scale=s))
    ref = np.asarray(ref_fused_linear(x, ws[0].w, residual=res, w_scale=ws[0].scale.reshape(-1)), np.float32)
    err = lambda fn: float(np.max(np.abs(np.asarray(fn(*args[0]), np.float32) - ref)))
    b = device_times(base, args, reps=10)["busy_us"]
    print(name, "current kernel", round(b, 2), "us; err", err(base), flush=True)
    tiles = []
    for S in (2, 4, 8):
        for bf in (8, 16, 32):
            for bd in (256, 512, 1024):
                if K // S < bd: continue
                for warps, stages in ((4, 2), (4, 4), (8, 2)):
                    tiles.append((S, bf, bd, warps, stages, False))
        for bf in (16, 32, 64):
            for bd in (256, 512):
                if K // S < bd: continue
                for stages in (3, 4):
                    tiles.append((S, bf, bd, 4, stages, True))
    rows = time_tilings(lambda t: jax.jit(lambda x, w, s: splitk(x, w, s, res, S=t[0], bf=t[1], bd=t[2], warps=t[3], stages=t[4], mma=t[5])),
                        tiles, args, reps=5, check=err)
    for r in rows[:8]:
        print("  ", r, flush=True)
    out.append(dict(name=name, current_us=b, best=[(list(r[0]), r[1], r[2]) for r in rows[:12]]))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "splitk.json"), "w"), indent=1)
