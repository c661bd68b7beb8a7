"""Experiment (not adopted): the second half of a batch-1 decoder layer in one kernel:
o_proj, the residual add, the post-attention RMSNorm, gate_up, SwiGLU, down and the second
residual add.

    x1 = x + a @ W_o.T
    y  = x1 + down(silu(gate(rms_norm(x1))) * up(rms_norm(x1)))

Why: every weight-streaming kernel on the H200 loses a few us against its bytes, even
XLA's split-K Triton GEMMs (o [4096, 4096]: 10.3 us + 1.3 us of split reduction for
33.6 MB, 7.4 us of bytes at 4.54 TB/s), and the tail of a batch-1 layer is three of them
plus two RMSNorm fusions (11.4 + 2.8 + 54.6 + 32.7 us per layer in the decode step for
386 MB, 85 us of bytes). The hope: with the three streams in one grid, handing over through
atomic counters, HBM keeps streaming across the op boundaries.

How (Pallas, Triton backend): one grid of P_o + P_gu + P_d programs. Each program takes a
ticket from an atomic counter; the ticket, not program_id, says what it does (the scheme of
explore_mlp_ticket.py):
- ticket < P_o: o rows [t fo, (t + 1) fo) against a, plus the residual -> x1 (an output).
- next P_gu tickets: gate and up rows [j c, (j + 1) c) against rms_norm(x1), SwiGLU'd ->
  act (an output); they first wait until all P_o o-programs have counted.
- last P_d tickets: down rows against act, plus x1 -> y; they wait for all gate_up programs.
A program waits only on programs with earlier tickets: no deadlock. While it waits it may
read its first ``pf`` weight tiles (an L2 prefetch). Numerics are fused_linear's three
kernels in a row: bit for bit equal to that composition with the same tiles (checked on
the CPU interpreter and on the H200).

Outcome on the H200 (2026-11-21, jax 0.11.2, profiler GPU time, 2 rotating weight sets;
raw docs/bench/2026-11-21_v8_layer_tail_{sweep,phases}.json): best 106.4 us over 64 tilings
against 104.2 for the engine's path (fused_linear o, XLA norm + gate_up, fused_linear down)
and 102.4 for the XLA ops. Cutting the grid after each phase: the o phase costs 13.6 us
(11.8 alone, the difference the ticket, the counter memset and the branches), gate_up
+62.0 (60.7 alone with the same tiles), down +31.3 (31.7 alone). So a phase boundary
inside the kernel costs what a kernel boundary does: the loss is each phase's ramp and
drain and its stream rate, not the launch. The prefetch while waiting changed nothing
(pf 0 / 2 / 4 / 8 within 1 us); 8 warps were 40-90% slower.

--timeline reads %globaltimer and %smid in every program (inline PTX) at its start, at
the end of its wait and at the end of its stream (raw
docs/bench/2026-11-21_v8_layer_tail_timeline{1,2,3}.json). With 64-row gate_up programs:
- The hand-over costs ~1 us: the last o program ends at 10.2 us, the first gate_up
  program is through its wait at 11.3 us. The hand-over to down costs 0.8 us.
- gate_up takes 60.7 us for 235 MB, against 55-56 us for XLA's GEMM. Its 224 programs
  are 1.7 waves on 132 SMs. Equal programs stream for 18-33 us, so the second wave
  drains for ~11 us with 86 down to 1 SMs busy.
- With pf = 4 the down streams are ~2 us shorter (from L2), but gate_up's drain is
  ~2.5 us longer.
One wave of 112-row programs (128 programs) balances well (5% spread), but one SM's
stream is then too slow:
- as 7 x 2 row blocks of 16 (blocks (32, 256, 112, 128, 32, 512, 4, 3, 0, 0)): 125 us per
  program, 15 GB/s;
- as two masked 128-row tiles: 88 us, 21 GB/s;
- against ~35 GB/s per SM needed on 128 SMs.

    PYTHONPATH=.:scripts python scripts/experiments/explore_layer_tail.py [--sweep] [--phases B]
        [--time B1;B2] [--timeline B1;B2]   # GPU (CPU: the checks, interpreted)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from gpu_trace import device_times, time_tilings
from kernels_pallas.fused_linear import fused_linear_gpu, ref_fused_linear, silu_mul_rounded, stream_rows

# counters (i32[4], zero at the start of a call): ticket, o programs done, gate_up done
_TICKET, _O_DONE, _GU_DONE = 0, 1, 2


def ref_attn_out_mlp(a, x, w_o, norm_w, w_gu, w_d, *, eps):
    """jnp reference (XLA ops). a [..., Hq]; x [..., H]; w_o [H, Hq]; norm_w [H];
    w_gu [2I, H] (gate rows, then up rows); w_d [H, I]. -> y [..., H]"""
    x1 = ref_fused_linear(a, w_o, residual=x)
    gu = ref_fused_linear(x1, w_gu, prologue="rmsnorm", norm_w=norm_w, eps=eps)
    return ref_fused_linear(gu, w_d, prologue="silu_mul", residual=x1)


def _pow2(n: int, pref: int, least: int) -> int:
    b = pref
    while b >= least and n % b:
        b //= 2
    return b if b >= least else 0


def default_blocks(H: int, Hq: int, I: int, dtype):
    """(fo, bd_o, c, bd_gu, fd, bd_d, num_warps, num_stages, pf): rows per o program and
    its K tile, gate/up rows per gate_up program and its K tile, rows per down program and
    its K tile, warps, pipeline stages, prefetch tiles per weight while waiting. None
    where no MMA tile divides the shapes (bf16 / f16 weights only, as fused_linear's MMA
    stream)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    fo, bdo = _pow2(H, 32, 16), _pow2(Hq, 256, 32)
    c, bdg = _pow2(I, 64, 16), _pow2(H, 256, 32)
    fd, bdd = _pow2(H, 32, 16), _pow2(I, 512, 32)
    if not all((fo, bdo, c, bdg, fd, bdd)):
        return None
    return (fo, bdo, c, bdg, fd, bdd, 4, 3, 4)


def _now(dep):
    """%globaltimer (ns, low 32 bits) read after `dep` (an i32 the read depends on, so that
    the compiler neither merges nor hoists the reads); also %smid. -> (i32[2] time, i32[2] SM),
    both entries the same (Triton stores blocks, not scalars, from a block op)."""
    def asm(reg):
        (v,) = plt.elementwise_inline_asm(f"mov.u32 $0, {reg};", args=[jnp.full((2,), dep, jnp.int32)],
                                          constraints="=r,r", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct((2,), jnp.int32)])
        return v

    t, sm = asm("%globaltimer_lo"), asm("%smid")
    return t, sm


def _release(ctr_ref, idx, interpret):
    if not interpret:  # (the interpreter runs one program at a time and has no barrier)
        plt.debug_barrier()  # every thread's stores before the (release) count
    plt.atomic_add(ctr_ref, (jnp.int32(idx),), jnp.int32(1))


def _acquire(ctr_ref, idx, target, rows, *, block_d, n_tiles, sink_ref, interpret):
    """Wait until counter idx reaches target; meanwhile read up to n_tiles [n, block_d]
    tiles of each weight in rows (the first ones this program will stream) so that they
    are in L2 when the stream starts. Their max goes to sink_ref (keeps the loads)."""
    if interpret:
        return jnp.int32(target)  # programs run in ticket order: every earlier program has counted
    poll = lambda: plt.atomic_add(ctr_ref, (jnp.int32(idx),), jnp.int32(0))  # noqa: E731  acq_rel read
    n = poll()
    if n_tiles:
        w0, r0 = rows[0]
        dt = w0.dtype

        def body(carry):
            _, i, m = carry
            d0 = pl.multiple_of(i * block_d, block_d)
            for w, r in rows:
                m = jnp.maximum(m, w[r, pl.ds(d0, block_d)])
            return poll(), i + 1, m

        n, _, m = lax.while_loop(lambda c: (c[0] < target) & (c[1] < n_tiles), body,
                                 (n, jnp.int32(0), jnp.full((r0.size, block_d), -jnp.inf, dt)))
        sink_ref[pl.program_id(0)] = jnp.max(m.astype(jnp.float32))
    return lax.while_loop(lambda n: n < target, lambda n: poll(), n)


def _kernel(a_ref, x_ref, wo_ref, nw_ref, wgu_ref, wd_ref, _ctr_in, y_ref, x1_ref, act_ref, ctr_ref, sink_ref,
            *trace_ref, H, Hq, I, fo, bdo, c, bdg, fd, bdd, pf, masked, eps, interpret):
    # a [1, Hq]; x, y, x1 [1, H]; act [1, I]; wo [H, Hq]; wgu [2I, H]; wd [H, I]; nw [H];
    # ctr i32[4] (aliased in and out); sink f32[grid].
    f32 = jnp.float32
    dt = wo_ref.dtype
    rnd = lambda v: v.astype(dt).astype(f32)  # noqa: E731  a projection's output rounding
    p_o, p_gu = H // fo, I // c
    t = plt.atomic_add(ctr_ref, (jnp.int32(_TICKET),), jnp.int32(1))
    acquire = functools.partial(_acquire, sink_ref=sink_ref, interpret=interpret)

    def trace(col, dep):  # --timeline: trace_ref i32[grid * 4]: start, waited, end (ns), SM per ticket
        # (2-wide stores: Triton stores a block op's result as a block; each store's second
        # entry is overwritten by the next one, the last one's is the SM)
        if trace_ref:
            ns, sm = _now(dep)
            val = jnp.where(lax.broadcasted_iota(jnp.int32, (2,), 0) == 0, ns, sm)
            trace_ref[0][pl.ds(t * 4 + col, 2)] = val

    def bits(v):  # an i32 that depends on v's values
        return lax.bitcast_convert_type(jnp.sum(v), jnp.int32)

    trace(0, t)

    @pl.when(t < p_o)
    def _o_proj():
        r0 = pl.multiple_of(t * fo, fo)
        trace(1, t + 1)
        (y,) = stream_rows(a_ref, [(wo_ref, pl.ds(r0, fo))], None, prologue="none", K=Hq, block_d=bdo, eps=eps,
                           mma=True)
        trace(2, bits(y))
        cols = pl.ds(r0, fo)
        x1_ref[0, cols] = (x_ref[0, cols].astype(f32) + rnd(y)).astype(dt)
        _release(ctr_ref, _O_DONE, interpret)

    def _gate_up_masked(r0):
        # rows [r0, r0 + c) of gate and of up as one [tile, bdg] tile each (tile: the next
        # power of two), the rows past c masked out of the loads, so that c = 112 puts the
        # 14336 features on 128 programs (one wave) with two dots per K step
        tile = 1 << (c - 1).bit_length()
        trace(1, acquire(ctr_ref, _O_DONE, p_o, [], block_d=bdg, n_tiles=0))
        row_ok = lax.broadcasted_iota(jnp.int32, (tile, bdg), 0) < c

        def body(i, carry):
            ag, au, ss = carry
            d0 = pl.multiple_of(i * bdg, bdg)
            xs = x1_ref[0, pl.ds(d0, bdg)].astype(f32)
            ss = ss + jnp.sum(xs * xs)
            h = (xs * nw_ref[pl.ds(d0, bdg)].astype(f32)).astype(dt)
            hm = jnp.where(lax.broadcasted_iota(jnp.int32, (16, bdg), 0) == 0, h[None, :], jnp.zeros((), dt))
            wg = plt.load(wgu_ref.at[pl.ds(r0, tile), pl.ds(d0, bdg)], mask=row_ok, other=0.0)
            wu = plt.load(wgu_ref.at[pl.ds(I + r0, tile), pl.ds(d0, bdg)], mask=row_ok, other=0.0)
            return ag + plt.dot(hm, wg, trans_b=True), au + plt.dot(hm, wu, trans_b=True), ss

        z = jnp.zeros((16, tile), f32)
        ag, au, ss = lax.fori_loop(0, H // bdg, body, (z, z, jnp.zeros((), f32)))
        row0 = lax.broadcasted_iota(jnp.int32, (16, tile), 0) == 0
        scale = lax.rsqrt(ss / H + eps)
        g = jnp.sum(jnp.where(row0, ag, 0.0), axis=0) * scale
        u = jnp.sum(jnp.where(row0, au, 0.0), axis=0) * scale
        trace(2, bits(g))
        act = silu_mul_rounded(rnd(g), rnd(u), dt).astype(dt)
        plt.store(act_ref.at[pl.ds(0, 1), pl.ds(r0, tile)], act[None, :],
                  mask=lax.broadcasted_iota(jnp.int32, (1, tile), 1) < c)
        _release(ctr_ref, _GU_DONE, interpret)

    @pl.when((t >= p_o) & (t < p_o + p_gu))
    def _gate_up():
        if c & (c - 1) and masked:  # c rows per program, not a power of two: masked pow2 tiles
            _gate_up_masked((t - p_o) * c)
            return
        # c rows per program as nb row blocks of `sub` (a power of two: Triton's tiles), e.g.
        # c = 112 (masked = 0) as 7 x 16 rows: Llama-3.1-8B's 14336 features on 128 programs
        sub = c & -c if c & -c <= 64 else 64
        nb = c // sub
        r0 = pl.multiple_of((t - p_o) * c, sub)
        rows = ([(wgu_ref, pl.ds(r0 + k * sub, sub)) for k in range(nb)]
                + [(wgu_ref, pl.ds(I + r0 + k * sub, sub)) for k in range(nb)])
        trace(1, acquire(ctr_ref, _O_DONE, p_o, rows[:1] + rows[nb:nb + 1], block_d=bdg, n_tiles=pf))
        ys = stream_rows(x1_ref, rows, nw_ref, prologue="rmsnorm", K=H, block_d=bdg, eps=eps, mma=True)
        trace(2, bits(ys[0]))
        for k in range(nb):
            act_ref[0, pl.ds(r0 + k * sub, sub)] = silu_mul_rounded(rnd(ys[k]), rnd(ys[nb + k]), dt).astype(dt)
        _release(ctr_ref, _GU_DONE, interpret)

    @pl.when(t >= p_o + p_gu)
    def _down():
        r0 = pl.multiple_of((t - p_o - p_gu) * fd, fd)
        rows = [(wd_ref, pl.ds(r0, fd))]
        trace(1, acquire(ctr_ref, _GU_DONE, p_gu, rows, block_d=bdd, n_tiles=pf))
        (y,) = stream_rows(act_ref, rows, None, prologue="none", K=I, block_d=bdd, eps=eps, mma=True)
        trace(2, bits(y))
        cols = pl.ds(r0, fd)
        y_ref[0, cols] = (x1_ref[0, cols].astype(f32) + rnd(y)).astype(dt)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret", "timeline", "grid_cut"))
def attn_out_mlp_gpu(a, x, w_o, norm_w, w_gu, w_d, *, eps=1e-6, blocks=None, interpret=False, timeline=False,
                     grid_cut=None):
    """The kernel on one row: a [1, Hq], x [1, H]. blocks: see default_blocks, plus an
    optional 10th entry, masked (default 1): a gate_up row count c that is not a power of
    two runs as masked power-of-two tiles (1) or as row blocks of 16-64 (0). -> y [1, H]
    (timeline, GPU only: (y, i32[grid, 4]) with each ticket's start, end of wait, end of
    stream (%globaltimer ns) and SM). grid_cut: run only the first grid_cut tickets (the
    phases before them; see phases())."""
    H, Hq = w_o.shape
    I = w_gu.shape[0] // 2
    fo, bdo, c, bdg, fd, bdd, warps, stages, pf, *masked = blocks or default_blocks(H, Hq, I, w_o.dtype)
    grid = grid_cut or H // fo + I // c + H // fd
    whole = pl.BlockSpec()
    dt = w_o.dtype
    outs = pl.pallas_call(
        functools.partial(_kernel, H=H, Hq=Hq, I=I, fo=fo, bdo=bdo, c=c, bdg=bdg, fd=fd, bdd=bdd, pf=pf,
                          masked=bool(masked[0]) if masked else True, eps=eps, interpret=interpret),
        grid=(grid,),
        in_specs=[whole] * 7,
        out_specs=[whole] * (6 if timeline else 5),
        out_shape=[jax.ShapeDtypeStruct((1, H), dt), jax.ShapeDtypeStruct((1, H), dt),
                   jax.ShapeDtypeStruct((1, I), dt), jax.ShapeDtypeStruct((4,), jnp.int32),
                   jax.ShapeDtypeStruct((grid,), jnp.float32)]
        + ([jax.ShapeDtypeStruct((grid * 4,), jnp.int32)] if timeline else []),
        input_output_aliases={6: 3},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"attn_out_mlp_o{fo}_c{c}_d{fd}_pf{pf}",
    )(a, x, w_o, norm_w, w_gu, w_d, jnp.zeros((4,), jnp.int32))
    return (outs[0], outs[5].reshape(grid, 4)) if timeline else outs[0]


def timeline(blocks, sets, H, I, eps, calls=6):
    """Per-phase timeline of the kernel from its own %globaltimer reads (the last of
    `calls` calls over rotating weights): when the phase's programs start, end waiting and
    end streaming (us from the first program's start), how many SMs stream in each
    microsecond, and the HBM-idle gaps between phases."""
    fo, _, c, *_ = blocks
    fn = jax.jit(lambda *a: attn_out_mlp_gpu(*a, eps=eps, blocks=blocks, timeline=True))
    for i in range(calls):
        _, tr = fn(*sets[i % len(sets)])
    tr = np.asarray(jax.device_get(tr)).astype(np.int64)
    t0 = tr[:, 0].min()
    rel = ((tr[:, :3] - t0) % (1 << 32)) / 1e3  # us
    n_o, n_gu = H // fo, I // c
    names = [("o", slice(0, n_o)), ("gate_up", slice(n_o, n_o + n_gu)), ("down", slice(n_o + n_gu, None))]
    out = {"blocks": blocks, "total_us": float(rel[:, 2].max()), "sms": int(len(set(tr[:, 3].tolist())))}
    for name, sl in names:
        r = rel[sl]
        dur = r[:, 2] - r[:, 1]
        out[name] = {k: [round(float(q), 2) for q in np.percentile(v, [0, 50, 100])]
                     for k, v in (("start", r[:, 0]), ("waited", r[:, 1]), ("end", r[:, 2]), ("stream_us", dur))}
    edges = np.arange(0, out["total_us"] + 1.0, 1.0)
    active = [[int(((rel[sl, 1] < e + 1) & (rel[sl, 2] > e)).sum()) for e in edges] for _, sl in names]
    out["streaming_per_us"] = list(zip(edges.tolist(), *active))
    print("timeline", blocks, "total", round(out["total_us"], 2), "us on", out["sms"], "SMs", flush=True)
    for name, _ in names:
        print(f"  {name:8s}", out[name], flush=True)
    print("  us: programs streaming (o, gate_up, down):", " ".join(
        f"{int(e)}:{a}/{b}/{d}" for e, a, b, d in out["streaming_per_us"]), flush=True)
    return out


def phases(blocks, sets, H, Hq, I, eps, reps):
    """GPU time of the kernel with its grid cut after the o phase, after gate_up, and whole,
    against fused_linear alone with the same tiles and stages (the phase sum)."""
    fo, bdo, c, bdg, fd, bdd, w, st, pf = blocks[:9]
    res = {}
    for label, grid in (("o", H // fo), ("o+gate_up", H // fo + I // c), ("all", H // fo + I // c + H // fd)):
        call = functools.partial(attn_out_mlp_gpu, eps=eps, blocks=blocks, grid_cut=grid)
        res["kernel_" + label] = device_times(jax.jit(call), sets, reps=reps)["busy_us"]
    res["alone_o"] = device_times(jax.jit(lambda a, x, wo, nw, wgu, wd: fused_linear_gpu(
        a, wo, residual=x, blocks=(fo, bdo, w, st, True))), sets, reps=reps)["busy_us"]
    res["alone_gate_up"] = device_times(jax.jit(lambda a, x, wo, nw, wgu, wd: fused_linear_gpu(
        x, wgu, nw, prologue="rmsnorm", eps=eps, blocks=(c, bdg, w, st, True))), sets, reps=reps)["busy_us"]
    res["alone_down"] = device_times(jax.jit(lambda a, x, wo, nw, wgu, wd: fused_linear_gpu(
        jnp.tile(x, (1, -(-I // H)))[:, :I], wd, residual=x, blocks=(fd, bdd, w, st, True))),
        sets, reps=reps)["busy_us"]
    print("phases", blocks, {k: round(v, 2) for k, v in res.items()}, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--phases", default="", help="blocks tuple: time the kernel cut after each phase, and "
                    "fused_linear alone with the same tiles")
    ap.add_argument("--time", default="", help="blocks tuples (';'-separated) to time")
    ap.add_argument("--timeline", default="", help="blocks tuples (';'-separated): per-phase timeline from the "
                    "kernel's own clock reads")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"  # elsewhere: tiny shapes, interpreter, the checks only
    H, Hq, I, eps = (4096, 4096, 14336, 1e-5) if gpu else (128, 256, 512, 1e-5)
    fl = functools.partial(fused_linear_gpu, interpret=not gpu)
    bf, f32 = jnp.bfloat16, jnp.float32
    key = jax.random.PRNGKey(7)

    def rnd(i, shape, scale):
        return (scale * jax.random.normal(jax.random.fold_in(key, i), shape, f32)).astype(bf)

    sets = [(rnd(10 * s, (1, Hq), 1.0), rnd(10 * s + 1, (1, H), 1.0), rnd(10 * s + 2, (H, Hq), 0.02),
             (1 + rnd(10 * s + 3, (H,), 0.1).astype(f32)).astype(bf), rnd(10 * s + 4, (2 * I, H), 0.02),
             rnd(10 * s + 5, (H, I), 0.02)) for s in range(args.sets)]
    nbytes = sum(int(np.prod(w.shape)) * 2 for w in sets[0][2:])
    ref = jax.jit(lambda *a: ref_attn_out_mlp(*a, eps=eps))
    engine = jax.jit(lambda a, x, wo, nw, wgu, wd: fl(
        ref_fused_linear(x1 := fl(a, wo, residual=x), wgu, prologue="rmsnorm", norm_w=nw, eps=eps),
        wd, residual=x1, prologue="silu_mul"))
    blocks0 = default_blocks(H, Hq, I, bf)

    def mega(blocks):
        return jax.jit(lambda *a: attn_out_mlp_gpu(*a, eps=eps, blocks=blocks, interpret=not gpu))

    want = ref(*sets[0]).astype(f32)
    err = lambda y: float(jnp.max(jnp.abs(y.astype(f32) - want)) / jnp.max(jnp.abs(want)))  # noqa: E731
    fo, bdo, c, bdg, fd, bdd, w, st, pf = blocks0
    x1 = fl(sets[0][0], sets[0][2], residual=sets[0][1], blocks=(fo, bdo, w, st, True))
    gu = fl(x1, sets[0][4], sets[0][3], prologue="rmsnorm", eps=eps, blocks=(c, bdg, w, st, True))
    comp = fl(gu, sets[0][5], residual=x1, prologue="silu_mul", blocks=(fd, bdd, w, st, True))
    one = mega(blocks0)
    y0 = one(*sets[0])
    out = dict(date=str(np.datetime64("today")), jax=jax.__version__, device=jax.devices()[0].device_kind,
               bytes=nbytes, default_blocks=blocks0, err_kernel=err(y0), err_engine=err(engine(*sets[0])),
               bitwise_vs_composition=bool(jnp.array_equal(y0, comp)))
    print(out, flush=True)
    if not gpu:
        return
    for label, fn in (("xla", ref), ("engine_path", engine), ("one_kernel", one)):
        t = device_times(fn, sets, reps=args.reps)
        out[label] = dict(us=t["busy_us"], kernels={k: round(v, 2) for k, v in t["kernels_us"].items()})
        print(label, round(t["busy_us"], 2), out[label]["kernels"], f"{nbytes / t['busy_us'] / 1e6:.3f} TB/s",
              flush=True)
    if args.time:
        out["time"] = time_tilings(mega, [tuple(int(v) for v in b.split(",")) for b in args.time.split(";")], sets,
                                   reps=args.reps, check=lambda fn: err(fn(*sets[0])), log="  time (us, err)")
    if args.timeline:
        out["timeline"] = [timeline(tuple(int(v) for v in b.split(",")), sets, H, I, eps)
                           for b in args.timeline.split(";")]
    if args.phases:
        out["phases"] = phases(tuple(int(v) for v in args.phases.split(",")), sets, H, Hq, I, eps, args.reps)
    if args.sweep:
        grid = itertools.product((32,), (256,), (32, 64), (256,), (32,), (512, 1024), (4, 8), (3, 4), (0, 2, 4, 8))
        out["sweep"] = time_tilings(mega, list(grid), sets, reps=max(3, args.reps // 2), log="  sweep")
        for b, us, _ in out["sweep"][:8]:
            print("  best", b, us, flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "explore_layer_tail.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
