"""Experiment (not adopted): the whole batch-1 MLP (RMSNorm + gate_up + SwiGLU + down) as
one weight stream, to save the kernel boundaries between gate_up and down.

Program p owns intermediate features [p*c, (p+1)*c): it streams those gate and up rows
(with the factored RMSNorm of kernels_pallas/fused_linear.py), forms act = silu(g) * u,
then streams the matching down weights and writes its partial [H] (f32); XLA sums the
partials in program order, rounds, adds the residual. --transposed reads down as [I, H]
(contiguous rows per program) instead of the HF [H, I] column slices.

Outcome on the H200 (2026-11-21, jax 0.11.2, GPU time; docs/benchmarks.md, raw
docs/bench/2026-11-21_v7_explore_mlp_*.json): 130.6 us (HF layout) and 108.3 us
(transposed) at best, against 91 us for the engine's path (XLA gate_up + the fused down
kernel): one program's two phases run back to back, and c rows per program are too few
to keep the weight stream full.

    PYTHONPATH=.:scripts python scripts/experiments/explore_mlp.py [--transposed]
"""
from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fused_linear import fused_linear_gpu, ref_fused_linear, stream_rows

f32 = jnp.float32


def _kernel(x_ref, wg_ref, wu_ref, nw_ref, wd_ref, o_ref, *, H, c, bd, bf2, eps, wt):
    dt = wg_ref.dtype
    gy, uy = stream_rows(x_ref, [wg_ref, wu_ref], nw_ref, prologue="rmsnorm", K=H, block_d=bd, eps=eps)
    rnd = lambda a: a.astype(dt).astype(f32)  # noqa: E731
    g, u = rnd(gy), rnd(uy)
    sig = rnd(1.0 / rnd(1.0 + rnd(jnp.exp(-g))))
    act = rnd(rnd(g * sig) * u)  # [c]

    def body(j, carry):
        f0 = pl.multiple_of(j * bf2, bf2)
        if wt:
            t = wd_ref[:, pl.ds(f0, bf2)].astype(f32)  # [c, bf2]
            o_ref[0, pl.ds(f0, bf2)] = jnp.sum(t * act[:, None], axis=0)
        else:
            t = wd_ref[pl.ds(f0, bf2), :].astype(f32)  # [bf2, c]
            o_ref[0, pl.ds(f0, bf2)] = jnp.sum(t * act[None, :], axis=1)
        return carry

    lax.fori_loop(0, H // bf2, body, 0)


@functools.partial(jax.jit, static_argnames=("c", "bd", "bf2", "warps", "stages", "interpret", "wt"))
def fused_mlp(x, w_gu, nw, w_d, residual, *, c=64, bd=512, bf2=128, warps=4, stages=3, interpret=False, wt=False):
    I2, H = w_gu.shape
    I = I2 // 2
    P = I // c
    parts = pl.pallas_call(
        functools.partial(_kernel, H=H, c=c, bd=bd, bf2=bf2, eps=1e-5, wt=wt),
        grid=(P,),
        in_specs=[pl.BlockSpec(), pl.BlockSpec((c, H), lambda p: (p, 0)),
                  pl.BlockSpec((c, H), lambda p: (p + P, 0)), pl.BlockSpec(),
                  pl.BlockSpec((c, H), lambda p: (p, 0)) if wt else pl.BlockSpec((H, c), lambda p: (0, p))],
        out_specs=pl.BlockSpec((1, H), lambda p: (p, 0)),
        out_shape=jax.ShapeDtypeStruct((P, H), f32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"fused_mlp_c{c}",
    )(x, w_gu, w_gu, nw, w_d)
    y = jnp.sum(parts, axis=0).astype(w_gu.dtype)
    return (residual.astype(f32) + y.astype(f32)).astype(w_gu.dtype)


def reference(x, w_gu, nw, w_d, residual):
    gu = ref_fused_linear(x, w_gu, prologue="rmsnorm", norm_w=nw, eps=1e-5)
    return ref_fused_linear(gu, w_d, prologue="silu_mul", residual=residual)


def main():
    gpu = jax.default_backend() == "gpu"
    from gpu_trace import device_times
    H, I = (4096, 14336) if gpu else (256, 512)
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    x = jax.random.normal(keys[0], (1, H), f32).astype(jnp.bfloat16)
    nw = (1 + 0.1 * jax.random.normal(keys[1], (H,), f32)).astype(jnp.bfloat16)
    r = jax.random.normal(keys[2], (1, H), f32).astype(jnp.bfloat16)
    n = 2 if gpu else 1
    wgus = [(0.02 * jax.random.normal(keys[3 + i], (2 * I, H), f32)).astype(jnp.bfloat16) for i in range(n)]
    wds = [(0.02 * jax.random.normal(keys[5 + i], (H, I), f32)).astype(jnp.bfloat16) for i in range(n)]
    sets = [(x, wgus[i], nw, wds[i], r) for i in range(n)]
    ref_fn = jax.jit(reference)
    want = ref_fn(*sets[0]).astype(f32)
    scale = float(jnp.max(jnp.abs(want)))
    rows = []
    t = device_times(ref_fn, sets, reps=5) if gpu else {"busy_us": 0, "kernels_us": {}}
    print(f"XLA reference (unfused ops): {t['busy_us']:.2f} us "
          f"{ {k[:30]: round(v, 2) for k, v in t['kernels_us'].items()} }", flush=True)
    cur = jax.jit(lambda x, wgu, nw, wd, r: fused_linear_gpu(
        ref_fused_linear(x, wgu, prologue="rmsnorm", norm_w=nw, eps=1e-5), wd, None, None, r, prologue="silu_mul",
        interpret=not gpu))
    t = device_times(cur, sets, reps=5) if gpu else {"busy_us": 0, "kernels_us": {}}
    print(f"current engine path (XLA norm + gate_up, fused_linear down): {t['busy_us']:.2f} us "
          f"{ {k[:30]: round(v, 2) for k, v in t['kernels_us'].items()} }", flush=True)
    mb = (3 * I * H * 2) / 1e6
    ap = argparse.ArgumentParser()
    ap.add_argument("--transposed", action="store_true", help="down weight as [I, H]")
    wt = ap.parse_args().transposed
    bf2s = (256, 512, 1024) if wt else (64, 128, 256)
    cfgs = [(c, bd, bf2, w, s) for c in ((16, 32, 64) if wt else (32, 64)) for bd in (256, 512) for bf2 in bf2s
            for w in (4, 8) for s in (2, 3)] if gpu else [(32, 64, 64, 4, 2)]
    if wt:
        sets = [(x, wgus[i], nw, jnp.asarray(wds[i].T), r) for i in range(n)]
    for c, bd, bf2, w, s in cfgs:
        fn = jax.jit(functools.partial(fused_mlp, c=c, bd=bd, bf2=bf2, warps=w, stages=s, interpret=not gpu, wt=wt))
        try:
            err = float(jnp.max(jnp.abs(fn(*sets[0]).astype(f32) - want))) / scale
            tt = device_times(fn, sets, reps=5) if gpu else {"busy_us": 0.0, "kernels_us": {}}
            rows.append((tt["busy_us"], (c, bd, bf2, w, s), err, {k[:24]: round(v, 2) for k, v in tt["kernels_us"].items()}))
        except Exception as e:  # noqa: BLE001
            rows.append((1e9, (c, bd, bf2, w, s), str(e)[:160], {}))
    rows.sort(key=lambda r_: r_[0])
    for us, cfg, err, ks in rows[:15]:
        print(f"  {cfg} {us:8.2f} us {mb / us if us else 0:5.2f} TB/s err {err} {ks}", flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "explore_mlp.json"), "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
