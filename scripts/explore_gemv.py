"""Exploration (temporary): where a batch-1 decode step's GPU time goes, and whether a Pallas
GEMV streams weights faster than XLA's at batch 1 / 8. Writes $OUT/explore_gemv.json."""

from __future__ import annotations

import collections
import functools
import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, os.path.dirname(__file__))
from gpu_trace import _device_events, device_times  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RES = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}


def save():
    with open(os.path.join(OUT, "explore_gemv.json"), "w") as f:
        json.dump(RES, f, indent=1)


def _dot_kernel(x_ref, w_ref, o_ref, *, block_d, num_d):
    bp, bf = x_ref.shape[0], w_ref.shape[0]

    def body(i, acc):
        d = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        return acc + lax.dot_general(x_ref[:, d], w_ref[:, d], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, num_d, body, jnp.zeros((bp, bf), jnp.float32)).astype(o_ref.dtype)


def _fma_kernel(x_ref, w_ref, o_ref, *, block_d, num_d):
    bf = w_ref.shape[0]

    def body(i, acc):
        d = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        return acc + w_ref[:, d].astype(jnp.float32) * x_ref[0, d].astype(jnp.float32)[None, :]

    acc = lax.fori_loop(0, num_d, body, jnp.zeros((bf, block_d), jnp.float32))
    o_ref[0, :] = jnp.sum(acc, axis=1).astype(o_ref.dtype)


def gemv(x, w, *, kind, bf, bd, warps, stages):
    b, D = x.shape
    F = w.shape[0]
    bp = max(16, b) if kind == "dot" else 1
    if bp != b:
        x = jnp.pad(x, ((0, bp - b), (0, 0)))
    kern = _dot_kernel if kind == "dot" else _fma_kernel
    out = pl.pallas_call(
        functools.partial(kern, block_d=bd, num_d=D // bd),
        grid=(F // bf,),
        in_specs=[pl.BlockSpec((bp, D), lambda i: (0, 0)), pl.BlockSpec((bf, D), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bp, bf), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((bp, F), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"gemv_{kind}_f{bf}_d{bd}_w{warps}_s{stages}",
    )(x, w)
    return out[:b]


def trace_kernels(fns_args, reps):
    """One profiler trace over several (fn, arg_sets); mean us per call by kernel name."""
    for fn, arg_sets in fns_args:
        for a in arg_sets:
            jax.block_until_ready(fn(*a))
    d = tempfile.mkdtemp(prefix="gemv_")
    with jax.profiler.trace(d):
        for fn, arg_sets in fns_args:
            for _ in range(reps):
                for a in arg_sets:
                    jax.block_until_ready(fn(*a))
    ev = _device_events(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    tot, cnt = collections.Counter(), collections.Counter()
    for n, ns in ev:
        tot[n] += ns
        cnt[n] += 1
    return {n: tot[n] / cnt[n] / 1e3 for n in tot}, dict(cnt)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def gemv_sweep():
    res = RES.setdefault("gemv", {})
    for name, (F, D) in SHAPES.items():
        ws = [jax.random.normal(jax.random.PRNGKey(i), (F, D), jnp.float32).astype(jnp.bfloat16) for i in range(4)]
        gb = F * D * 2
        for b in (1, 8):
            x = jax.random.normal(jax.random.PRNGKey(99), (b, D), jnp.float32).astype(jnp.bfloat16)
            ref = jax.jit(lambda x, w: jnp.einsum("bd,fd->bf", x, w, preferred_element_type=jnp.float32))
            xt = device_times(ref, [(x, w) for w in ws], reps=10)
            row = {"xla_us": xt["busy_us"], "xla_TBps": gb / xt["busy_us"] / 1e6, "xla_kernels": list(xt["kernels_us"])[:3]}
            exp = np.asarray(ref(x, ws[0]))
            cfgs = []
            for bf in ((16, 32, 64) if F >= 4096 else (16,)):
                for bd in (256, 512):
                    for st in (3, 4):
                        cfgs.append(dict(kind="dot", bf=bf, bd=bd, warps=4, stages=st))
            if b == 1:
                for bf in (16, 32):
                    for bd in (256, 512):
                        for st in (3, 4):
                            cfgs.append(dict(kind="fma", bf=bf, bd=bd, warps=4, stages=st))
            fns = []
            ok = {}
            for c in cfgs:
                if F % c["bf"] or D % c["bd"]:
                    continue
                fn = jax.jit(functools.partial(gemv, **c))
                try:
                    got = np.asarray(fn(x, ws[0]).astype(jnp.float32))
                except Exception as e:  # noqa: BLE001
                    ok[str(c)] = f"error {type(e).__name__}: {str(e)[:200]}"
                    continue
                err = float(np.max(np.abs(got - exp)) / (np.max(np.abs(exp)) + 1e-9))
                ok[str(c)] = err
                fns.append((c, fn))
            t0 = time.time()
            times, _ = trace_kernels([(fn, [(x, w) for w in ws]) for _, fn in fns], reps=10)
            cf = []
            for c, _ in fns:
                k = f"gemv_{c['kind']}_f{c['bf']}_d{c['bd']}_w{c['warps']}_s{c['stages']}"
                us = sum(v for n, v in times.items() if n.startswith(k))
                cf.append(dict(cfg=c, us=us, TBps=gb / us / 1e6 if us else None, err=ok[str(c)]))
            cf.sort(key=lambda r: r["us"] or 1e9)
            row["pallas"] = cf[:8]
            row["errors"] = {k: v for k, v in ok.items() if isinstance(v, str) or v > 2e-2}
            row["other_kernels"] = {n: v for n, v in times.items() if not n.startswith("gemv_")}
            row["trace_s"] = time.time() - t0
            res[f"{name}_b{b}"] = row
            best = cf[0] if cf else None
            print(f"{name} b={b}: xla {row['xla_us']:.1f} us {row['xla_TBps']:.2f} TB/s; best pallas "
                  f"{best and best['us']:.1f} us {best and best['TBps']:.2f} TB/s {best and best['cfg']}", flush=True)
            save()
        del ws


def step_breakdown():
    from bench import LLAMA_8B, inject, make_engine, random_tree
    from jspec.checkpoint.target import target_param_spec
    from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
    params = random_tree(target_param_spec(LLAMA_8B), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    eng = make_engine(LLAMA_8B, params, max_num_seqs=8, ctx=512, dtype="bfloat16", sched_steps=8)
    seqs = inject(eng, 1, 512, rng, max_tokens=64)
    assert all(eng.blocks.ensure_slots(s, 512 + 8) for s in seqs)
    sched = SchedulerOutput("decode", [ScheduledSeq(s, 1, True) for s in seqs], [])
    inp, _ = eng.runner.build_input(sched)
    r = eng.runner
    one = device_times(lambda: r.run(inp), [()], reps=5)
    multi = device_times(lambda: r.run(inp, 8), [()], reps=3)
    RES["step_one"] = {"busy_us": one["busy_us"], "kernels": dict(list(one["kernels_us"].items())[:40]),
                       "num_kernels": len(one["kernels_us"])}
    RES["step_multi8"] = {"busy_us": multi["busy_us"], "kernels": dict(list(multi["kernels_us"].items())[:40]),
                          "num_kernels": len(multi["kernels_us"])}
    print("one step busy", one["busy_us"], "multi8 busy", multi["busy_us"], flush=True)
    for n, v in list(multi["kernels_us"].items())[:25]:
        print(f"  {v/8:9.1f} us/step  {n[:100]}", flush=True)
    save()
    del eng, params


if __name__ == "__main__":
    what = sys.argv[1:] or ["step", "gemv"]
    if "step" in what:
        step_breakdown()
    if "gemv" in what:
        gemv_sweep()
    save()
