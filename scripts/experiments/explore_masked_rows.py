"""Experiment: would the qkv projection ([6144, 4096], 96 programs of 2 x 32 rows today)
stream faster over 128 programs of 48 rows, with 8 of each 32-row tile's rows masked off?

The qkv + RoPE kernel pairs rows j and j + D/2 of a head in one program, as two 32-row tiles
(Triton tiles are powers of two). 6144 rows over 128 programs is 24 pairs each: two 32-row
tiles with 8 rows masked (no bytes loaded for them) or filled with duplicate rows. This
times a plain GEMV (x loaded per K block, the tensor-core form of fused_linear.stream_rows)
in each layout, so only the programs' shape differs:
- block: 96 programs, two contiguous 32-row tiles (today's layout);
- gather: the same rows through index arrays (what a row-gathered kernel pays);
- masked: 128 programs, two gathered 32-row tiles of 24 real rows, the rest masked;
- dup: 128 programs, the 8 extra rows of each tile repeat a real row (no masks).
Checked against XLA's einsum; GPU time per call over 4 rotating weight sets.

Outcome on the H200 (2026-11-22, jax 0.11.2; docs/benchmarks.md, thirteenth session; raw
docs/bench/2026-11-22_v13_masked_rows.json): no gain, so the qkv kernel keeps its 96
programs. At the best tiling (256-wide K blocks, 4 stages) block 14.65 / 14.67 us, gather
14.85 / 14.60, masked 14.63 / 14.70, dup 14.68 / 14.69 (two rounds; XLA 15.67). The masked
layouts were ~1 us faster only at tilings that are slower for every layout (6 stages,
512-wide blocks: 15.1-15.4 against 16.0-16.3).

    PYTHONPATH=.:scripts python scripts/experiments/explore_masked_rows.py     # GPU
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from gpu_trace import device_times

F, K, TILE = 6144, 4096, 32


def _kernel(x_ref, w_ref, o_ref, *, layout, real, bd):
    i = pl.program_id(0)
    k = jnp.arange(TILE, dtype=jnp.int32)
    if layout == "block":
        tiles = [pl.ds(i * 2 * TILE, TILE), pl.ds(i * 2 * TILE + TILE, TILE)]
    elif layout == "gather":
        tiles = [i * 2 * TILE + k, i * 2 * TILE + TILE + k]
    else:
        tiles = [i * 2 * real + jnp.minimum(k, real - 1), i * 2 * real + real + jnp.minimum(k, real - 1)]
    mask = (k < real)[:, None] if layout == "masked" else None

    def load(t, d0):
        if mask is None:
            return w_ref[t, pl.ds(d0, bd)]
        return plt.load(w_ref.at[t, pl.ds(d0, bd)], mask=mask, other=0.0)

    def body(j, accs):
        d0 = pl.multiple_of(j * bd, bd)
        h = x_ref[0, pl.ds(d0, bd)]
        hm = jnp.where(lax.broadcasted_iota(jnp.int32, (16, bd), 0) == 0, h[None, :], jnp.zeros((), h.dtype))
        return tuple(a + plt.dot(hm, load(t, d0), trans_b=True) for a, t in zip(accs, tiles))

    accs = lax.fori_loop(0, K // bd, body, tuple(jnp.zeros((16, TILE), jnp.float32) for _ in tiles))
    for a, t in zip(accs, tiles):
        y = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 0) == 0, a, 0.0), axis=0).astype(o_ref.dtype)
        if layout == "masked":
            plt.store(o_ref.at[t], y, mask=k < real)
        else:
            o_ref[t] = y  # dup: repeated rows store the same value twice


def gemv(x, w, *, layout, bd, stages, real=24):
    programs = F // (2 * TILE) if layout in ("block", "gather") else F // (2 * real)
    return pl.pallas_call(
        functools.partial(_kernel, layout=layout, real=real, bd=bd),
        grid=(programs,),
        out_shape=jax.ShapeDtypeStruct((F,), w.dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=stages),
        name=f"gemv_{layout}_d{bd}_s{stages}",
    )(x, w)


def main():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, K), jnp.float32).astype(jnp.bfloat16)
    ws = [(0.02 * jax.random.normal(jax.random.PRNGKey(1 + i), (F, K))).astype(jnp.bfloat16) for i in range(4)]
    ref = np.asarray(jnp.einsum("mk,fk->f", x, ws[0]).astype(jnp.float32))
    xla = jax.jit(lambda w: jnp.einsum("mk,fk->f", x, w))
    rows = [dict(layout="xla", us=device_times(xla, [(w,) for w in ws], reps=20)["busy_us"])]
    print(f"xla einsum: {rows[0]['us']:.2f} us", flush=True)
    for rnd in range(2):
        for bd, stages in ((256, 4), (256, 6), (512, 4)):
            for layout in ("block", "gather", "masked", "dup"):
                fn = jax.jit(functools.partial(gemv, x, layout=layout, bd=bd, stages=stages))
                try:
                    got = np.asarray(fn(ws[0]).astype(jnp.float32))
                    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                    us = device_times(fn, [(w,) for w in ws], reps=20)["busy_us"]
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a result too
                    err, us = None, f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(dict(round=rnd, layout=layout, bd=bd, stages=stages, us=us, rel_err=err))
                print(f"round {rnd} {layout:7s} bd {bd} stages {stages}: "
                      f"{us if isinstance(us, str) else f'{us:.2f} us'}  rel err {err}", flush=True)
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "explore_masked_rows.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
