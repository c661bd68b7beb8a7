"""Probe: one Mosaic GPU kernel streaming a chain of batch-1 GEMVs without stopping.

The question behind issue 7's last bar: per op, every compiler's batch-1 GEMV streams at
2.9-3.9 TB/s on the H200 (ramp-up and drain around each kernel; explore_mgpu_gemv.py shows
Mosaic GPU's TMA pipeline at XLA's rate too), while 90% of the roofline needs ~4.0 TB/s
across a whole layer. Can a persistent kernel keep HBM busy across the op boundaries?

The kernel: 132 programs (one per SM), two warpgroups each. The memory warpgroup streams the
program's weight tiles for every op in the chain back to back (emit_pipeline_warp_specialized
with pipeline_state START / STEADY / STOP: it never waits for an op's input, only for ring
slots). The compute warpgroup, before each op, waits on a grid-wide semaphore for the
previous op's outputs, TMA-loads its slice of them as the B operand (8 rows: one per
split-K partial, zero-padded), and multiplies each 64-row weight tile with wgmma; the
partials' sum is the row sum of the accumulator. So while the compute side waits at a
boundary, the ring is already filling with the next op's tiles.

Chain (Llama-3.1-8B shapes, one layer's bytes): qkv [6144, 4096] -> o [4096, 4096] ->
gate_up [28672, 4096] -> down [4096, 14336], each op's input being the first K entries of
the previous op's output (the attention / norm / SwiGLU in between are left out: this
probes the streaming, not the layer's math).

    PYTHONPATH=.:scripts python scripts/experiments/explore_mgpu_chain.py [--out FILE] [--xla] [--probe] \
        [--runs "qkv,o,gate_up,down@128:4 gate_up@64:8 qkv,o,gate_up,downx4@256:4:nomma ..."]
        (OPS[xLAYERS]@TILE_K:STAGES[:nomma|:noflush|:nozero|:nostore|:sep|:pdl[:pfN][:apfN][:ro][:dr|:mr][:rs]];
        xLAYERS repeats the chain, nomma streams only, noflush multiplies but never reads or
        stores the accumulator, nozero / nostore flush it but store no zero rows / nothing,
        sep runs one kernel per op, pdl one kernel per op chained by programmatic dependent
        launch, pfN with it an L2 prefetch of N tiles past the ring before the wait; "attn"
        in OPS puts a latency-bound attention stand-in between qkv and o, apfN makes it
        prefetch N [64, 256] tiles of o's weights per program into L2, ro makes each kernel
        exit without waiting for its output stores to land, dr keeps one wgmma in flight, mr
        releases each weight slot before the flush, rs stores the row sums from registers;
        times are the union of the kernels' intervals)

CPU: lowers the kernel for "cuda" (an API check).

Outcome (2026-11-22, H200, jax 0.11.2; docs/benchmarks.md, ninth session): one layer's four
GEMVs in 108-110 us (3.97-4.04 TB/s) against 116.5 us for XLA's GEMV chain and 118.9 us for
the same four ops as separate kernels; four layers in one kernel 110.4 us per layer (no
further gain); streaming only (no multiplies) 104.8-105.9 us per layer, and the same with
the multiplies but without the per-row-block flush (105.3): the flush and the op
boundaries it sits on cost the ~4.5 us, not the wgmmas. A megakernel on this base would
land near 89% of the roofline before attention, norms and RoPE: not adopted; 90% needs
cheaper boundaries (finer dependencies than one grid barrier per op) and attention hidden
behind the next op's weights.

Outcome of the separate-kernel modes (2026-11-22, tenth session): with PDL, and with the
custom calls kept out of XLA's command buffers (inside a CUDA graph the kernels do not
overlap), one kernel per op streams a layer's four GEMVs in 106.1-107.1 us (92.6-93.1% of
the same run's GEMV probe), 101.0-101.6 us without the output flush (97.4-98.0%); the
attention stand-in adds 5.0-6.0 us per layer that neither the ring nor an L2 prefetch hides
(the prefetches only add time). Extrapolated: 88.6% of the roofline before the norms,
RoPE, KV write and SwiGLU; 90% needs the output hand-over to cost <= 3.3 us per layer
instead of 5.2.

Eleventh session (2026-11-22): the flush taken apart, four layers against :noflush in the
same runs: 1.9-2.0 us per layer are the TMA stores (:nostore), 2.7-3.3 us the register and
shared-memory work before them; not waiting for the stores to land (:ro) and releasing
each weight slot before the flush (:mr) save nothing, keeping a wgmma in flight (:dr)
costs 6.5 us per layer, rings small enough for two kernels' programs per SM stream slower
than they hand over; storing the row sums from registers (:rs) saves 0.5-0.8 us per layer,
and the flush still costs 4.5: the last row block's flush in each kernel's tail.
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

ROWS = 64  # weight rows per tile: one wgmma M
N = 8  # B columns: the split-K partials of the previous op (zero-padded)

CHAIN = (("qkv", 6144, 4096, 4), ("attn", 8192, 128, 0), ("o", 4096, 4096, 2), ("gate_up", 28672, 4096, 2),
         ("down", 4096, 14336, 4))
# "attn": a stand-in for batch-1 decode attention in a chain of separate kernels (attn_standin):
# its "weight" is a [8192, 128] bf16 buffer (2 MB, the KV of 512 tokens x 8 heads); its split
# count 0 marks it in reference() and in the --xla chain.


def plan(chain, ncta, tile_k):
    ops = []
    for name, F, K, s in chain:
        R, groups = F // ROWS, ncta // s
        if ncta % s or (K // s) % tile_k or F % ROWS:
            raise ValueError(f"{name}: splits {s} / tile_k {tile_k} do not fit {F}x{K} on {ncta} programs")
        ops.append(dict(name=name, F=F, K=K, R=R, s=s, groups=groups, units=-(-R // groups),
                        kper=K // s, ksteps=K // s // tile_k))
    return ops


def chain_gemv(x0, ws, *, splits, tile_k=128, stages=4, ncta=132, names=None, mma=True, flush=True, pdl=False, pf=0, ro=False,
               store="all", dr=False, mr=False, rs=False):
    """x0 [N, K0] bf16 -> the last op's outputs P [N, F_last] bf16 (row j: split j's partial;
    y = P.sum(0)), plus every op's P. mma=False skips the multiplies (a streaming-only
    diagnostic: the outputs are then garbage); flush=False multiplies but never reads or
    stores the accumulator (the same, to split the compute side's cost). pdl=True (one op
    per kernel, for a chain of kernels): the kernel lets its successor launch at once
    (griddepcontrol.launch_dependents) and, launched itself with programmatic dependent
    launch, waits for its predecessor (griddepcontrol.wait) only before loading x0, so its
    memory warpgroup fills the ring with weight tiles while the predecessor drains. pf > 0
    (with pdl): before that wait the compute warpgroup also prefetches into L2 the pf weight
    tiles after the ring's first fill, so more of the op's weights are in flight while the
    predecessor (e.g. attention) runs than the ring holds. ro=True (with pdl): a program
    exits once its last output store has read shared memory, without waiting for the write
    to land (the successor's griddepcontrol.wait covers the grid's memory flush). store
    (diagnostics, the outputs then wrong): "all" stores the unit's sums and the zero rows
    past the splits, "data" only the sums, "none" neither (the flush's register and shared
    memory work stays). dr=True (one op per kernel): a weight slot is released one step after
    its wgmma is issued (BlockSpec delay_release=1), so the compute warpgroup keeps one wgmma
    in flight (wgmma_wait(1)) instead of waiting for each before the next tile. mr=True: the
    compute warpgroup releases each weight slot itself (manual consumed barriers) as soon as
    its wgmma is done, before a row block's flush, so the ring refills during the flush.
    rs=True: the row sums go from registers straight to global memory (no shared memory,
    fence or TMA store; the zero rows are stored once, up front)."""
    chain = [(names[i] if names else str(i), w.shape[0], w.shape[1], s) for i, (w, s) in enumerate(zip(ws, splits))]
    ops = plan(chain, ncta, tile_k)
    n_ops = len(ops)
    max_ks = max(o["ksteps"] for o in ops)
    sw = plgpu.find_swizzle(tile_k * 16)
    tr = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    if pdl and n_ops > 1:
        raise ValueError("pdl chains kernels of one op each")
    if rs and not pdl:
        raise ValueError("rs stores the zero rows before the wait: one op per kernel (pdl)")
    if dr and mr:
        raise ValueError("dr and mr both decide when a slot is released")
    if dr and n_ops > 1:
        raise ValueError("dr: a pipeline of pipelines does not support delay_release")
    if ro and not pdl:
        raise ValueError("ro needs pdl: in one kernel the grid semaphore must follow the landed writes")
    if len(ops) > 1 and any(o["units"] * o["ksteps"] % stages for o in ops):
        raise ValueError(f"every op's steps {[o['units'] * o['ksteps'] for o in ops]} must divide by stages {stages}")

    def kernel(x0_ref, *refs):
        w_refs, p_refs = refs[:n_ops], refs[n_ops:2 * n_ops]
        x_smem, out_smem, zero_smem, xbar = refs[2 * n_ops:]
        # One semaphore for the whole grid (kernel scratch semaphores are per program);
        # it persists across calls, so the kernel leaves it at zero.
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if n_ops > 1 else None
        c = lax.axis_index("c")
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        def rows(o, u):
            """The row block of this program's unit u of op o (clamped) and whether it is real."""
            r_raw = c // o["s"] + o["groups"] * u
            return jnp.minimum(r_raw, o["R"] - 1), r_raw < o["R"]

        def store_zero_rows(i, o, r):
            """Op i's output rows past its splits, for row block r (the consumer's B operand
            reads all N rows)."""
            plgpu.copy_smem_to_gmem(zero_smem.at[pl.ds(0, N - o["s"])],
                                    p_refs[i].at[pl.ds(o["s"], N - o["s"]), pl.ds(r * ROWS, ROWS)])

        def make_pipe(body, ctx, i, state):
            o = ops[i]
            s_idx = c % o["s"]

            def index(u, k):
                r, real = rows(o, u)
                # A program past the op's last row block (the units do not divide evenly)
                # re-reads one tile, from L2, instead of streaming a real slab from HBM.
                return r, jnp.where(real, s_idx * o["ksteps"] + k, s_idx * o["ksteps"])

            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(o["units"], o["ksteps"]), memory_registers=40,
                in_specs=[plgpu.BlockSpec((ROWS, tile_k), index, transforms=tr, delay_release=int(dr))],
                wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
                compute_context=ctx, pipeline_state=state, manual_consumed_barriers=mr)

        ignore = lambda *_, **__: None
        allocs_spec = make_pipe(ignore, ignore, 0, plgpu.PipelinePipeline.START).get_allocations(w_refs[0])

        def scope(allocs):
            for i, o in enumerate(ops):
                s_idx = c % o["s"]
                state = (None if n_ops == 1 else plgpu.PipelinePipeline.START if i == 0 else
                         plgpu.PipelinePipeline.STOP if i == n_ops - 1 else plgpu.PipelinePipeline.STEADY)
                src = x0_ref if i == 0 else p_refs[i - 1]

                def ctx(eval_pipeline, i=i, o=o, s_idx=s_idx, src=src):
                    # Runs on the compute warpgroup only: the memory warpgroup is already
                    # streaming this op's tiles into the ring while we wait here.
                    if i == 0:
                        zero_smem[...] = jnp.zeros((N, ROWS), jnp.bfloat16)
                        if rs:  # the rows past the splits, stored before the wait
                            plgpu.commit_smem()
                            for u in range(o["units"]):
                                r, real = rows(o, u)

                                pl.when(real & (s_idx == 0))(functools.partial(store_zero_rows, i, o, r))
                        if pdl:
                            for t in range(stages, min(stages + pf, o["units"] * o["ksteps"])):
                                r, _ = rows(o, t // o["ksteps"])
                                plgpu.async_prefetch(w_refs[i].at[pl.ds(r * ROWS, ROWS),
                                                                  pl.ds((s_idx * o["ksteps"] + t % o["ksteps"]) * tile_k, tile_k)])
                            plgpu.griddepcontrol_wait()
                    else:
                        pl.semaphore_wait(sem, ncta * i, decrement=False)
                    for k0 in range(0, o["ksteps"], 32):  # <= 32 barriers per group
                        kks = range(k0, min(k0 + 32, o["ksteps"]))
                        for kk in kks:
                            plgpu.copy_gmem_to_smem(
                                src.at[:, pl.ds(s_idx * o["kper"] + kk * tile_k, tile_k)],
                                x_smem.at[kk], xbar.at[kk - k0])
                        for kk in kks:
                            plgpu.barrier_wait(xbar.at[kk - k0])

                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=ro)
                        if sem is not None:
                            pl.semaphore_signal(sem, 1)

                    pl.run_scoped(acc_scope, plgpu.ACC((ROWS, N), jnp.float32))

                def body(idxs, w_smem, *rest, i=i, o=o, s_idx=s_idx):
                    acc_ref = rest[-1]
                    u, k = idxs
                    if mma:
                        plgpu.wgmma(acc_ref, w_smem, plgpu.transpose_ref(x_smem.at[k], (1, 0)))
                        plgpu.wgmma_wait(int(dr))
                    if mr:
                        plgpu.barrier_arrive(rest[0])

                    @pl.when(k == o["ksteps"] - 1)
                    def _flush():  # the unit's row block is done: row-sum the partials, store
                        if not (mma and flush):
                            return
                        if dr:
                            plgpu.wgmma_wait(0)
                        y = acc_ref[...].sum(axis=1).astype(jnp.bfloat16)
                        acc_ref[...] = jnp.zeros((ROWS, N), jnp.float32)
                        r, real = rows(o, u)
                        if rs:
                            @pl.when(real)
                            def _():
                                p_refs[i][s_idx, pl.ds(r * ROWS, ROWS)] = y
                            return
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[...] = y
                        plgpu.commit_smem()
                        if store == "none":
                            return

                        @pl.when(real)
                        def _():
                            plgpu.copy_smem_to_gmem(out_smem, p_refs[i].at[s_idx, pl.ds(r * ROWS, ROWS)])
                            if store == "all":
                                pl.when(s_idx == 0)(functools.partial(store_zero_rows, i, o, r))
                    return acc_ref

                make_pipe(body, ctx, i, state)(w_refs[i], allocations=allocs)

            if sem is not None:
                @pl.when((c == 0) & (lax.axis_index("wg") == 0))
                def _():
                    pl.semaphore_wait(sem, ncta * n_ops)  # back to zero for the next call

        pl.run_scoped(scope, allocs_spec, collective_axes="wg")

    out_type = tuple(jax.ShapeDtypeStruct((N, o["F"]), jnp.bfloat16) for o in ops)
    f = plgpu.kernel(
        kernel, out_type=out_type,
        scratch_types=[plgpu.SMEM((max_ks, N, tile_k), jnp.bfloat16, transforms=tr),
                       plgpu.SMEM((ROWS,), jnp.bfloat16),
                       plgpu.SMEM((N, ROWS), jnp.bfloat16),
                       plgpu.Barrier(num_barriers=min(max_ks, 32))],
        grid=(ncta,), grid_names=("c",), num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return f(x0, *ws)


def attn_standin(p, kv, w_next=None, *, ctas=32, pdl=False, apf=0):
    """A stand-in for batch-1 decode attention between qkv and o: `ctas` programs each wait
    for the qkv kernel, read their share of kv [R, 128] one 16 KB tile after another (a
    latency-bound chain like attention's), then pass p[:, :4096] (q's columns) on as the
    output. It lets its successor launch at once, so with PDL the o kernel's programs can
    stream their first weight tiles while it runs. apf > 0: once through its wait, each
    program also prefetches into L2 apf [64, 256] tiles of w_next (the o weights), so HBM
    streams o's weights while the attention's latency chain runs."""
    steps = kv.shape[0] // (64 * ctas)
    cols = 4096 // ctas

    def kernel(p_ref, kv_ref, *refs):
        w_ref = refs[0] if apf else None
        o_ref, buf, obuf, bar = refs[-4:]
        c = lax.axis_index("c")
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        if apf:
            per_row = w_ref.shape[1] // 256
            for j in range(apf):
                t = c * apf + j
                plgpu.async_prefetch(w_ref.at[pl.ds((t // per_row) * 64, 64), pl.ds((t % per_row) * 256, 256)])

        def step(i, carry):
            plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds((c * steps + i) * 64, 64)], buf, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            return carry

        lax.fori_loop(0, steps, step, 0)
        plgpu.copy_gmem_to_smem(p_ref.at[:, pl.ds(c * cols, cols)], obuf, bar.at[1])
        plgpu.barrier_wait(bar.at[1])
        plgpu.copy_smem_to_gmem(obuf, o_ref.at[:, pl.ds(c * cols, cols)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((N, 4096), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((64, 128), jnp.bfloat16), plgpu.SMEM((N, cols), jnp.bfloat16),
                       plgpu.Barrier(num_barriers=2)],
        grid=(ctas,), grid_names=("c",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(
            p, kv, *([w_next] if apf else []))


def separate_gemvs(x0, ws, *, splits, names, **kw):
    """The same chain as one kernel per op (pdl=True: chained by programmatic dependent
    launch); each kernel's input is the previous one's partials."""
    ps, p = [], x0
    apf = kw.pop("apf", 0)
    for i, (w, s, name) in enumerate(zip(ws, splits, names)):
        if name == "attn":
            p = attn_standin(p, w, ws[i + 1], pdl=kw.get("pdl", False), apf=apf)
        else:
            p = chain_gemv(p, [w], splits=[s], names=[name], **kw)[0]
        ps.append(p)
    return tuple(ps)


def reference(x0, ws, splits):
    """The kernel's math in jnp: each op's B = the previous P (rows = bf16 split partials)."""
    ps, p = [], x0
    for w, s in zip(ws, splits):
        if s == 0:  # the attention stand-in passes q's columns on
            p = p[:, :4096]
            ps.append(p)
            continue
        F, K = w.shape
        xk = p[:, :K].astype(jnp.float32).sum(0)  # the row sum of the partials = this op's input
        parts = jnp.stack([jnp.einsum("k,fk->f", xk[j * K // s:(j + 1) * K // s], w[:, j * K // s:(j + 1) * K // s].astype(jnp.float32))
                           for j in range(s)]).astype(jnp.bfloat16)
        p = jnp.zeros((N, F), jnp.bfloat16).at[:s].set(parts)
        ps.append(p)
    return ps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--runs", default="qkv,o,gate_up,down@128:4",
                    help="space-separated OPS[xLAYERS]@TILE_K:STAGES[:FLAG...] (the flags and the attn stand-in: "
                         "see the module docstring); each is built, checked and timed")
    ap.add_argument("--xla", action="store_true", help="also time XLA's GEMV chain for each run's ops")
    ap.add_argument("--probe", action="store_true",
                    help="measure the HBM bandwidth first (bench.measure_bandwidth) and report each run against it")
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "runs": []}
    bw = None
    if a.probe and gpu:
        from bench import measure_bandwidth
        res["probe"] = measure_bandwidth(quick=False)
        bw = res["probe"]["best_TBps"]
        print("bandwidth probe (TB/s):", {k: round(v, 3) for k, v in res["probe"].items()}, flush=True)
    for run in a.runs.split():
        ops_s, cfg = run.split("@")
        layers = 1
        if "x" in ops_s.split(",")[-1]:  # "qkv,o,gate_up,downx4": the chain repeated 4 times
            ops_s, layers = ops_s.rsplit("x", 1)
            layers = int(layers)
        tile_k, stages, *flags = cfg.split(":")
        tile_k, stages, mma, flush = int(tile_k), int(stages), "nomma" not in flags, "noflush" not in flags
        sep, pdl, ro = "sep" in flags or "pdl" in flags, "pdl" in flags, "ro" in flags
        pf = sum(int(f[2:]) for f in flags if f.startswith("pf"))
        apf = sum(int(f[3:]) for f in flags if f.startswith("apf"))
        if "attn" in ops_s.split(",") and not sep:
            raise ValueError(f"{run}: the attention stand-in runs only in a chain of separate kernels (:sep / :pdl)")
        chain = [c for c in CHAIN if c[0] in ops_s.split(",")] * layers
        ws = [[jax.random.normal(jax.random.PRNGKey(10 * j + i), (F, K), jnp.bfloat16) * 0.02
               for i, (_, F, K, _) in enumerate(chain)] for j in range(2)]
        x0 = jnp.zeros((N, chain[0][2]), jnp.bfloat16).at[0].set(
            jax.random.normal(jax.random.PRNGKey(5), (chain[0][2],), jnp.bfloat16))
        splits = [c[3] for c in chain]
        kw = dict(splits=splits, tile_k=tile_k, stages=stages, names=[c[0] for c in chain], mma=mma, flush=flush,
                  ro=ro, store="data" if "nozero" in flags else "none" if "nostore" in flags else "all",
                  dr="dr" in flags, mr="mr" in flags, rs="rs" in flags)
        fn = jax.jit(functools.partial(separate_gemvs, pdl=pdl, pf=pf, apf=apf, **kw) if sep else functools.partial(chain_gemv, **kw))
        if not gpu:
            try:
                fn.trace(x0, ws[0]).lower(lowering_platforms=("cuda",))
            except Exception as e:  # noqa: BLE001
                print(run, "does not lower:", type(e).__name__, str(e)[:200])
                continue
            print("lowered", run, [(o["name"], o["units"], o["ksteps"]) for o in plan([c for c in chain if c[3]], 132, tile_k)])
            continue
        from gpu_trace import device_times
        mb = sum(F * K * 2 for _, F, K, _ in chain) / 1e6
        row = {"run": run, "mb": mb}
        try:
            ref = reference(x0, ws[0], splits)
            for rep in range(2):  # twice: the semaphore must be back at zero for the second call
                got = fn(x0, ws[0])
                errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32).sum(0) - r.astype(jnp.float32).sum(0))) /
                              jnp.max(jnp.abs(r.astype(jnp.float32).sum(0)))) for g, r in zip(got, ref)]
            t = device_times(fn, [(x0, w) for w in ws], reps=10)
        except Exception as e:  # noqa: BLE001
            print(run, "failed:", type(e).__name__, str(e)[:300], flush=True)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["runs"].append(row)
            continue
        row.update(rel_err=errs, us=t["union_us"], busy_us=t["busy_us"], TBps=mb / t["union_us"],
                   kernels=t["kernels_us"])
        print(f"{run}: {t['union_us']:.2f} us for {mb:.1f} MB = {mb / t['union_us']:.3f} TB/s (kernel durations "
              f"summed {t['busy_us']:.2f} us), rel err per op {[round(e, 4) for e in errs]}", flush=True)
        if bw:
            row["of_probe"] = mb / t["union_us"] / bw
            print(f"  {row['of_probe']:.1%} of the probe's {bw:.3f} TB/s", flush=True)
        if a.xla:
            def xla_plain(x0, ws):
                v = x0[0]
                for w, s in zip(ws, splits):
                    # the attention stand-in (split 0) passes q's columns on, as in reference()
                    v = v[:4096] if s == 0 else jnp.einsum("k,fk->f", v[:w.shape[1]], w)
                return v
            tp = device_times(jax.jit(xla_plain), [(x0, w) for w in ws], reps=10)
            gemm = sum(v for k, v in tp["kernels_us"].items() if "gemm" in k or "nvjet" in k or "reduce" in k)
            print(f"  XLA GEMV chain: {tp['busy_us']:.2f} us ({gemm:.2f} us in its GEMMs + split reduces) "
                  f"{ {k[:30]: round(v, 2) for k, v in tp['kernels_us'].items()} }", flush=True)
            row.update(xla_us=tp["busy_us"], xla_gemm_us=gemm, xla_kernels=tp["kernels_us"])
        res["runs"].append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
