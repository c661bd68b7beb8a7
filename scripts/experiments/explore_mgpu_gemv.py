"""Probe: does a Mosaic GPU (TMA + wgmma) batch-1 GEMV stream weights faster than XLA's?

Issue 7's last bar (batch-1 decode at >= 90% of the roofline) needs ~4.0 TB/s across each
layer; with Pallas' Triton backend the engine's projections stream at 2.9-3.6 TB/s, within
~1 us of XLA's own split-K GEMMs (docs/benchmarks.md, eighth session). This probe times a
Mosaic GPU kernel (plgpu.kernel: TMA loads of the weight tiles through emit_pipeline, the
tensor cores with the weight tile as the 64-row A operand and x padded to 8 columns as B)
on Llama-3.1-8B's four projection shapes against XLA's einsum, in one run.

    PYTHONPATH=.:scripts python scripts/experiments/explore_mgpu_gemv.py [--quick] [--out FILE]

CPU: lowers every tiling for the "cuda" platform (API check only; Mosaic GPU's interpreter
does not take transposed wgmma operands).

Outcome (2026-11-22, H200, jax 0.11.2; docs/benchmarks.md, ninth session): at XLA's rate,
not above it: o 11.21 us (XLA 10.79), down 30.58 us (XLA 29.94), best of 38 tilings each,
split-K sums included. Per op, TMA does not remove the ramp-up and drain; see
explore_mgpu_chain.py for the op boundaries.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def gemv_mgpu(w, x, *, tile_f=64, tile_k=128, stages=4, splits=1, n=8):
    """x [B<=n, K] @ w[F, K]^T -> [B, F] (w's dtype). Grid (F / tile_f, splits): each
    program streams a tile_f x (K / splits) slab of w through a `stages`-deep TMA pipeline
    into one wgmma accumulator [tile_f, n]; the splits' f32 partials are summed by XLA."""
    F, K = w.shape
    B = x.shape[0]
    if F % tile_f or K % (splits * tile_k) or B > n:
        raise ValueError(f"tiling {tile_f=} {tile_k=} {splits=} {n=} does not fit w {w.shape} x {x.shape}")
    xp = jnp.zeros((n, K), w.dtype).at[:B].set(x.astype(w.dtype))
    kper = K // splits
    sw = plgpu.find_swizzle(tile_k * 16)
    tr = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    osw = plgpu.find_swizzle(n * 32)
    otr = (plgpu.TilingTransform((8, osw // 4)), plgpu.SwizzleTransform(osw))

    def body(w_gmem, x_gmem, o_gmem, o_smem):
        fi = lax.axis_index("f")
        si = lax.axis_index("s")

        def scope(acc_ref):
            def step(_, w_smem, x_smem):
                plgpu.wgmma(acc_ref, w_smem, plgpu.transpose_ref(x_smem, (1, 0)))
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(
                step, grid=(kper // tile_k,),
                in_specs=[plgpu.BlockSpec((tile_f, tile_k), lambda k: (0, k), transforms=tr),
                          plgpu.BlockSpec((n, tile_k), lambda k: (0, k), transforms=tr)],
                max_concurrent_steps=stages)(
                    w_gmem.at[pl.ds(fi * tile_f, tile_f), pl.ds(si * kper, kper)],
                    x_gmem.at[:, pl.ds(si * kper, kper)])
            o_smem[...] = acc_ref[...]

        pl.run_scoped(scope, plgpu.ACC((tile_f, n), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(fi * tile_f, tile_f)])
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, F, n), jnp.float32),
        scratch_types=[plgpu.SMEM((tile_f, n), jnp.float32, transforms=otr)],
        grid=(F // tile_f, splits), grid_names=("f", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    part = f(w, xp)
    return (part[0] if splits == 1 else part.sum(0))[:, :B].T.astype(w.dtype)


SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}


def tilings(F, K, quick):
    out = []
    for tile_f, tile_k, stages in itertools.product((64, 128), (64, 128, 256), (2, 4, 6, 8)):
        if tile_f * tile_k * 2 * stages > 200 * 1024:
            continue
        for ctas in ((132, 264) if not quick else (132,)):
            splits = max(1, round(ctas / (F // tile_f)))
            while splits > 1 and K % (splits * tile_k):
                splits -= 1
            out.append((tile_f, tile_k, stages, splits))
    return sorted(set(out))[: 3 if quick else None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="o,qkv,down,gate_up")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    res = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "rows": []}
    for name in a.shapes.split(","):
        F, K = SHAPES[name]
        if a.quick:
            F, K = F // 8, K // 8
        ws = [jax.random.normal(jax.random.PRNGKey(i), (F, K), jnp.bfloat16) for i in range(2)]
        x = jax.random.normal(jax.random.PRNGKey(7), (1, K), jnp.bfloat16)
        ref = jnp.einsum("md,fd->mf", x.astype(jnp.float32), ws[0].astype(jnp.float32))
        mb = F * K * 2 / 1e6
        if not gpu:
            for t in tilings(F, K, a.quick):
                fn = jax.jit(functools.partial(gemv_mgpu, tile_f=t[0], tile_k=t[1], stages=t[2], splits=t[3]))
                fn.trace(ws[0], x).lower(lowering_platforms=("cuda",))
                print(name, t, "lowered")
            continue
        from gpu_trace import device_times, time_tilings
        xla = jax.jit(lambda v, w: jnp.einsum("md,fd->mf", v, w))
        xt = device_times(xla, [(x, w) for w in ws], reps=10)
        print(f"{name} {F}x{K} ({mb:.1f} MB): XLA {xt['busy_us']:.2f} us = {mb / xt['busy_us']:.3f} TB/s "
              f"{ {k[:40]: round(v, 2) for k, v in xt['kernels_us'].items()} }", flush=True)
        res["rows"].append({"shape": name, "impl": "xla", "us": xt["busy_us"], "kernels": xt["kernels_us"]})

        def check(fn):
            y = fn(x, ws[0]).astype(jnp.float32)
            return round(float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))), 5)

        rows = time_tilings(
            lambda t: jax.jit(lambda v, w, t=t: gemv_mgpu(w, v, tile_f=t[0], tile_k=t[1], stages=t[2], splits=t[3])),
            tilings(F, K, a.quick), [(x, w) for w in ws], reps=10, check=check, log=f"  {name}")
        for t, us, err in rows[:5]:
            if isinstance(us, float):
                print(f"  best {name} {t}: {us:.2f} us = {mb / us:.3f} TB/s, rel err {err}", flush=True)
        res["rows"] += [{"shape": name, "impl": "mgpu", "tiling": t, "us": us, "rel_err": err} for t, us, err in rows]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
