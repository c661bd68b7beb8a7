"""Paged attention on the GPU: correctness against the jnp reference, then timings.

Run on the H200: ``PYTHONPATH=. python3 scripts/bench_attention.py`` (writes
$OUT/attention.json when OUT is set). Steps, in one process so one device call does all:
  1. kernel == reference on ragged batches (every query mode, NaN-poisoned unused pages,
     junk page-table entries), bf16 GQA-4 and f32 GQA-1, several tuning variants;
  2. HBM bandwidth measured now: a large bf16 read-only column reduction and a large f32
     elementwise read+write; the best is the roofline;
  3. (a) decode, batch 32, context 4096, 32/8 heads, D 128, bf16, page sizes 16/32/64, over
     kernel variants, plus verify-8 and the jnp reference: KV bytes / time against that
     bandwidth (wall clock);
     (b) batch 1-8 by GPU time: verification Q = 8 / decode Q = 1 at batch 1, context 4096
     over a few tunings (b1_ratio), then today's defaults against the previous tuning rule
     at batch 1, 2, 4, 8 and context 512 / 4096 (small_batch).
Wall-clock timing (3a): each timed call is an unrolled lax.scan over NSETS different
(q, page table) sets inside one jit, so per-call dispatch does not count and L2 does not
serve a repeated table's KV. Medians of REPS. At batch 1-8 a call is 5-50 us and wall clock
times host launches too (+-20% between runs), so 3b uses GPU time from the profiler's
kernel records (scripts/gpu_trace.py), every set on its own pages (NSETS x 16.8 MB > the
50 MB L2 at batch 1). `--b1-ratio [--no-check] [--defaults-only]` runs only 3b's ratio;
`--b1-sweep [--ctx N]`: a GPU-time tuning sweep at batch 1 (Q = 1 and Q = 8), context 4096
or N.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention import ref_paged_attention
from kernels_pallas.paged_attention_gpu import _next_pow2, paged_attention_gpu
from kernels_pallas.tuning import DEVICES

NSETS = 16  # inner scan length: distinct (q, table) sets per timed call
REPS = 25
RESULTS: dict = {"date": "2026-11-21", "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}


def log(*a):
    print(*a, flush=True)


def median_time(f, *args, reps=REPS):
    jax.block_until_ready(f(*args))  # compile
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ---------------------------------------------------------------- 1. correctness
def ragged_batch(rng, *, B, Q, kv_heads, group, S, D, dtype, mode):
    """Random ragged batch with poisoned unused pages (same scheme as the tests)."""
    kv_lens = rng.integers(Q, 300, size=B).astype(np.int32)
    kv_lens[0] = 0  # an empty slot
    new = np.full(B, Q) if mode != "decode" else np.ones(B, int)
    new[0] = 0
    pages = [-(-int(n) // S) for n in kv_lens]
    W = max(pages) + 3
    used = sum(pages)
    P = used + 7
    perm = rng.permutation(P)
    owned, junk = perm[:used], perm[used:]
    table = rng.choice(junk, size=(B, W)).astype(np.int32)
    off = 0
    for b, n in enumerate(pages):
        table[b, :n] = owned[off : off + n]
        off += n
    H = kv_heads * group
    k = rng.standard_normal((P, S, kv_heads, D)).astype(np.float32)
    v = rng.standard_normal((P, S, kv_heads, D)).astype(np.float32)
    k[junk] = np.nan
    v[junk] = np.nan
    for b in range(B):
        for t in range(int(kv_lens[b]), pages[b] * S):
            k[table[b, t // S], t % S] = np.nan
            v[table[b, t // S], t % S] = np.nan
    q = rng.standard_normal((B, Q, H, D)).astype(np.float32)
    pos = (kv_lens - new)[:, None] + np.arange(Q)[None, :]
    causal = np.ones(B, bool) if mode != "dflash" else (rng.random(B) < 0.3)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(kv_lens), jnp.asarray(pos.astype(np.int32)), jnp.asarray(causal))


def check_correctness():
    rng = np.random.default_rng(0)
    variants = [dict(), dict(kv_splits=1), dict(block_kv=128, kv_splits=5), dict(block_kv=32, num_warps=8, num_stages=3),
                dict(kv_splits=3, split_dtype=jnp.float32)]
    modes = [("decode", 1), ("verify8", 8), ("dflash", 16), ("prefill32", 32)]
    rows, ok = [], True
    for dtype, group, kvh, tol in ((jnp.bfloat16, 4, 8, 2e-2), (jnp.float32, 1, 4, 2e-5)):
        for mode, Q in modes:
            args = ragged_batch(rng, B=6, Q=Q, kv_heads=kvh, group=group, S=16, D=128, dtype=dtype, mode=mode)
            with jax.default_matmul_precision("highest"):  # no TF32 in the f32 reference
                ref = np.asarray(jax.jit(ref_paged_attention, static_argnames="sm_scale")(*args, sm_scale=128**-0.5), np.float64)
            for var in variants:
                try:
                    out = np.asarray(paged_attention_gpu(*args, sm_scale=128**-0.5, **var), np.float64)
                    finite = bool(np.isfinite(out).all())
                    err = float(np.linalg.norm(np.nan_to_num(out - ref, nan=1e9)) / np.linalg.norm(ref))
                    good = finite and err < tol
                except Exception as e:  # keep going: one device call must report everything
                    finite, err, good = False, float("nan"), False
                    log(f"FAIL {mode} {jnp.dtype(dtype).name} {var}: {type(e).__name__}: {str(e)[:2000]}")
                    traceback.print_exc(limit=3)
                ok &= good
                rows.append(dict(mode=mode, dtype=jnp.dtype(dtype).name, group=group, variant=str(var), rel_err=err, finite=finite, ok=good))
                log(f"check {mode:9s} {jnp.dtype(dtype).name:8s} G={group} {str(var):50s} rel_err={err:.2e} finite={finite} {'ok' if good else 'FAIL'}")
    RESULTS["correctness"] = rows
    RESULTS["correct"] = ok
    return ok


# ---------------------------------------------------------------- 2. bandwidth
def measure_bandwidth():
    """Best of a few large memory-bound XLA ops (bytes read + written / median time)."""
    out = {}
    x = jax.random.normal(jax.random.key(1), (1 << 19, 8192), jnp.bfloat16)  # 8 GiB
    for name, f in (
        ("bf16_read_row_reduction_TBps", jax.jit(lambda x: jnp.sum(x, axis=1, dtype=jnp.float32))),
        ("bf16_read_col_reduction_TBps", jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32))),
    ):
        out[name] = x.size * 2 / median_time(f, x, reps=10) / 1e12
    del x
    y = jax.random.normal(jax.random.key(2), (1 << 30,), jnp.float32)  # 4 GiB in, 4 GiB out
    g = jax.jit(lambda y: y * 1.5 + 1.0)
    out["f32_elementwise_rw_TBps"] = y.size * 4 * 2 / median_time(g, y, reps=10) / 1e12
    del y
    out["best_TBps"] = max(out.values())
    log("bandwidth", {k: round(v, 3) for k, v in out.items()})
    RESULTS["bandwidth"] = out
    return out["best_TBps"]


# ---------------------------------------------------------------- 3. timings
def timing_inputs(*, B, Q, ctx, S, kvh=8, H=32, D=128, dtype=jnp.bfloat16, distinct_pages_per_set):
    """NSETS (q, table) sets over one cache; positions/kv_lens of a full context."""
    rng = np.random.default_rng(B * 1000 + Q + S)
    pps = ctx // S  # pages per sequence
    P = pps * B * (NSETS if distinct_pages_per_set else 1)
    key = jax.random.key(B + Q + S)
    k_pages = jax.random.normal(key, (P, S, kvh, D), dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (P, S, kvh, D), dtype)
    tables = []
    for i in range(NSETS):
        base = i * pps * B if distinct_pages_per_set else 0
        tables.append((base + rng.permutation(pps * B)).reshape(B, pps))
    tables = jnp.asarray(np.stack(tables).astype(np.int32))  # [NSETS, B, pps]
    qs = jax.random.normal(jax.random.fold_in(key, 2), (NSETS, B, Q, H, D), dtype)
    kv_lens = jnp.full((B,), ctx, jnp.int32)
    positions = jnp.broadcast_to(ctx - Q + jnp.arange(Q, dtype=jnp.int32), (B, Q))
    causal = jnp.ones((B,), bool)
    kv_bytes = B * ctx * kvh * D * 2 * jnp.dtype(dtype).itemsize  # K and V, read once
    return (qs, tables, k_pages, v_pages, kv_lens, positions, causal), kv_bytes


def time_attention(attn, inputs):
    """Seconds per attention call: a scan over the NSETS sets inside one jit."""

    @jax.jit
    def run(qs, tables, k_pages, v_pages, kv_lens, positions, causal):
        def body(acc, xs):
            q, table = xs
            o = attn(q, k_pages, v_pages, table, kv_lens, positions, causal)
            return acc + jnp.sum(o.astype(jnp.float32)), None

        # Unrolled: an XLA GPU while loop syncs with the host every iteration (~tens of us).
        return jax.lax.scan(body, jnp.float32(0), (qs, tables), unroll=True)[0]

    return median_time(run, *inputs) / NSETS


def previous_rule(B, Q, ctx, kvh=8, group=4, num_sms=DEVICES["NVIDIA H200"].num_sms):
    """The tuning the kernel chose before 2026-11-21, spelled out: ~2
    programs per SM, 4 warps, 2 stages, 16-row / 128-key programs for verification at small
    batch, and the split combine as jnp (XLA fusions)."""
    R = Q * group
    small_verify = Q > 1 and R <= 32 and B * kvh < num_sms
    br = 16 if small_verify else min(max(16, _next_pow2(R)), 128)
    bk = 128 if small_verify else 64
    programs = B * kvh * -(-R // br)
    splits = max(1, min(-(-ctx // bk), -(-2 * num_sms // programs)))
    return dict(block_rows=br, block_kv=bk, kv_splits=splits, num_warps=4, num_stages=2, split_combine="jnp")


def gpu_time(tuning, inputs, reps):
    """Mean GPU time per call (scripts/gpu_trace.py) over the NSETS sets, one call per set;
    tuning None: the jnp reference."""
    from gpu_trace import device_times

    (qs, tables, k_pages, v_pages, kv_lens, positions, causal), _ = inputs
    arg_sets = [(q, k_pages, v_pages, t, kv_lens, positions, causal) for q, t in zip(list(qs), list(tables))]
    fn = jax.jit(kernel_fn(**tuning)) if tuning is not None else jax.jit(ref_fn)
    return device_times(fn, arg_sets, reps=reps)


B1_TUNINGS = (
    ("defaults", {}, {}),
    ("jnp split combine", dict(split_combine="jnp"), dict(split_combine="jnp")),
    ("previous rule", previous_rule(1, 1, 4096), previous_rule(1, 8, 4096)),
    ("33 splits", dict(kv_splits=33), dict(kv_splits=33)),
    ("verify 16-row programs", {}, dict(block_rows=16)),
)


def b1_ratio(rows, reps=10, tunings=B1_TUNINGS):
    """Verify-8 / decode at batch 1, context 4096, by GPU time from the profiler's kernel
    records (scripts/gpu_trace.py): per call, the sum of the durations of everything it ran
    on the GPU (attention kernel + split combine), averaged over NSETS sets x reps
    calls. Wall-clock timing at batch 1 mixed in host launch cost (+-20% between runs).
    Each entry of `tunings` is (label, tuning for Q = 1, tuning for Q = 8)."""
    sets = {Q: timing_inputs(B=1, Q=Q, ctx=4096, S=16, distinct_pages_per_set=True) for Q in (1, 8)}
    out = {}
    for label, t1, t8 in tunings:
        res = {1: gpu_time(t1, sets[1], reps), 8: gpu_time(t8, sets[8], reps)}
        q1, q8 = res[1]["busy_us"], res[8]["busy_us"]
        out[label] = dict(q1_tuning=str(t1), q8_tuning=str(t8), q1_us=q1, q8_us=q8, ratio=q8 / q1,
                          q1_kernels=res[1]["kernels_us"], q8_kernels=res[8]["kernels_us"])
        rows.append(dict(label=f"GPU-time B1 ctx4096 {label}", case="b1_gpu_time", tuning=label, q1_us=q1, q8_us=q8,
                         ratio=q8 / q1))
        brk = lambda ks: ", ".join(f"{n[:40]} {us:.2f}" for n, us in list(ks.items())[:3])  # noqa: E731
        log(f"  GPU-time verify8/decode B1 ctx4096 {label:24s} {q1:6.2f} / {q8:6.2f} us = {q8 / q1:.3f}  "
            f"[Q1: {brk(res[1]['kernels_us'])}] [Q8: {brk(res[8]['kernels_us'])}]")
    ref = {Q: gpu_time(None, sets[Q], 3)["busy_us"] for Q in (1, 8)}
    log(f"  GPU-time jnp reference B1 ctx4096: Q1 {ref[1]:.2f} us, Q8 {ref[8]:.2f} us")
    RESULTS["b1_gpu_time"] = dict(per_tuning=out, reference_us=ref, reps=reps, nsets=NSETS)
    return out


def small_batch(reps=5):
    """Decode (Q = 1) and verify-8 at batch 1-8, context 512 and 4096, by GPU time: today's
    defaults against the previous tuning rule, so a default change is seen beyond batch 1."""
    out = []
    for ctx in (512, 4096):
        for B in (1, 2, 4, 8):
            for Q in (1, 8):
                inputs = timing_inputs(B=B, Q=Q, ctx=ctx, S=16, distinct_pages_per_set=True)
                new = gpu_time({}, inputs, reps)["busy_us"]
                old = gpu_time(previous_rule(B, Q, ctx), inputs, reps)["busy_us"]
                out.append(dict(B=B, Q=Q, ctx=ctx, default_us=new, previous_us=old))
                log(f"  GPU-time B{B} Q{Q} ctx{ctx}: defaults {new:6.2f} us, previous rule {old:6.2f} us ({new / old:.2f}x)")
                del inputs
    RESULTS["small_batch_gpu_time"] = out
    return out


def kernel_fn(**tuning):
    return lambda *a: paged_attention_gpu(*a, sm_scale=128**-0.5, **tuning)


def ref_fn(*a):
    return ref_paged_attention(*a, sm_scale=128**-0.5)


def try_time(label, fn, inputs, kv_bytes, bw, table, extra=None):
    try:
        t = time_attention(fn, inputs)
        row = dict(label=label, us=t * 1e6, TBps=kv_bytes / t / 1e12, frac_bw=kv_bytes / t / 1e12 / bw, **(extra or {}))
    except Exception as e:
        log(f"FAIL timing {label}: {type(e).__name__}: {str(e)[:1500]}")
        row = dict(label=label, us=float("nan"), TBps=float("nan"), frac_bw=float("nan"), error=str(e)[:300], **(extra or {}))
    log(f"time {label:58s} {row['us']:9.1f} us  {row['TBps']:.3f} TB/s  {row['frac_bw']:.1%} of bw")
    table.append(row)
    return row


def b1_sweep(reps=5, ctx=4096):
    """Batch-1 tuning sweep by GPU time at one context: Q = 1 over splits x block_kv x warps x
    stages, Q = 8 over the same and 16- or 32-row programs. The splits span ~1 to ~2 kv blocks
    per program (at 4096: 33, 48, 66; at 512: 5, 9, 17 with 16- to 128-key blocks)."""
    sets = {Q: timing_inputs(B=1, Q=Q, ctx=ctx, S=16, distinct_pages_per_set=True) for Q in (1, 8)}
    grid = [(Q, {}) for Q in (1, 8)]
    splits = (33, 48, 66) if ctx >= 4096 else (ctx // 128 + 1, ctx // 64 + 1, ctx // 32 + 1)
    for s in splits:
        for bk in (32, 64, 128) if ctx >= 4096 else (16, 32, 64, 128):
            for w in (2, 4):
                for st in (1, 2):
                    if s * bk > 2 * ctx or (ctx < 4096 and s * bk < ctx // 2):
                        continue
                    t = dict(kv_splits=s, block_kv=bk, num_warps=w, num_stages=st)
                    grid += [(1, t), (8, dict(t, block_rows=16)), (8, dict(t, block_rows=32))]
    rows = []
    for Q, t in grid:
        try:
            d = gpu_time(t, sets[Q], reps)
        except Exception as e:  # a tuning the lowering rejects
            log(f"FAIL Q{Q} {t}: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(dict(Q=Q, tuning=str(t), us=d["busy_us"], kernels=d["kernels_us"]))
    for Q in (1, 8):
        log(f"--- batch 1, ctx {ctx}, Q{Q}: fastest tunings (GPU time)")
        for r in sorted([r for r in rows if r["Q"] == Q], key=lambda r: r["us"])[:8]:
            log(f"  {r['us']:6.2f} us {r['tuning']}")
    RESULTS["b1_sweep"] = rows
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_b1_sweep.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0


def b32_gpu_time():
    """Decode batch 32, ctx 4096 (defaults) by the profiler's GPU time, against bench_common.py's
    probes (also GPU time: copy, column sum, weight-streaming GEMV) at start and end."""
    from bench_common import measure_bandwidth as probes
    from gpu_trace import device_times

    bw0 = probes(False)
    inputs, kv_bytes = timing_inputs(B=32, Q=1, ctx=4096, S=16, distinct_pages_per_set=False)
    qs, tables, kp, vp, kv_lens, positions, causal = inputs
    fn = kernel_fn()
    f = jax.jit(lambda q, t: fn(q, kp, vp, t, kv_lens, positions, causal))
    us = device_times(f, [(qs[i], tables[i]) for i in range(NSETS)], reps=5)["busy_us"]
    bw1 = probes(False)
    best = max(bw0["best_TBps"], bw1["best_TBps"])
    RESULTS["b32_gpu_time"] = dict(us=us, kv_bytes=kv_bytes, TBps=kv_bytes / us / 1e6, probes_start=bw0,
                                   probes_end=bw1, frac=kv_bytes / us / 1e6 / best)
    log(f"probes start {bw0}\nprobes end {bw1}")
    log(f"decode B32 ctx4096 defaults, GPU time: {us:.1f} us, {kv_bytes / us / 1e6:.3f} TB/s = "
        f"{kv_bytes / us / 1e6 / best:.1%} of {best:.3f} TB/s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_b32_gpu_time.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
    return 0


def main():
    log(f"jax {jax.__version__}, devices {jax.devices()}")
    if "--b32-gpu-time" in sys.argv:
        return b32_gpu_time()
    if "--b1-sweep" in sys.argv:
        return b1_sweep(ctx=int(sys.argv[sys.argv.index("--ctx") + 1]) if "--ctx" in sys.argv else 4096)
    if "--b1-ratio" in sys.argv:  # [kernel == reference,] the batch-1 verify/decode ratio by GPU time
        if "--no-check" not in sys.argv:
            check_correctness()
        b1_ratio([], tunings=B1_TUNINGS[:1] if "--defaults-only" in sys.argv else B1_TUNINGS)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "attention_b1_ratio.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
        return 0
    check_correctness()
    bw = measure_bandwidth()
    rows = []
    # (a) decode batch 32, context 4096: tuning sweep at page 16, a few at 32/64.
    sweep16 = [dict(), dict(kv_splits=1), dict(kv_splits=2), dict(kv_splits=4),
               dict(block_kv=128), dict(block_kv=128, kv_splits=1), dict(num_stages=3), dict(num_stages=3, kv_splits=4),
               dict(num_warps=8), dict(block_kv=128, num_warps=8, num_stages=3)]
    for S, sweep in ((16, sweep16), (32, [dict()]), (64, [dict(), dict(kv_splits=4), dict(block_kv=128)])):
        inputs, kv_bytes = timing_inputs(B=32, Q=1, ctx=4096, S=S, distinct_pages_per_set=False)
        for tuning in sweep:
            try_time(f"decode B32 ctx4096 S{S} kernel {tuning}", kernel_fn(**tuning), inputs, kv_bytes, bw, rows,
                     dict(case="decode_b32", page_size=S, tuning=str(tuning)))
        if S == 16:
            try_time("decode B32 ctx4096 S16 jnp reference", ref_fn, inputs, kv_bytes, bw, rows,
                     dict(case="decode_b32_ref", page_size=S))
            try_time("decode B32: scan floor, no attention", lambda q, *a: q, inputs, kv_bytes, bw, rows,
                     dict(case="floor_b32", page_size=S))
            qs8, _ = timing_inputs(B=32, Q=8, ctx=4096, S=S, distinct_pages_per_set=False)
            try_time("verify8 B32 ctx4096 S16 kernel {}", kernel_fn(), qs8, kv_bytes, bw, rows,
                     dict(case="verify8_b32", page_size=S, tuning="{}"))
            del qs8
        del inputs
    # (b) batch 1-8 by GPU time: verify-8 / decode at batch 1 over tunings, then today's
    # defaults against the previous rule at batch 1-8, context 512 / 4096.
    b1 = b1_ratio(rows)
    small_batch()
    RESULTS["timings"] = rows

    # Summary table last (the device reply carries the tail of the output).
    log(f"\n=== summary (H200, {RESULTS['device']}, jax {jax.__version__}) === bandwidth best {bw:.3f} TB/s")
    log("correct on GPU:", RESULTS["correct"])
    dec = [r for r in rows if r.get("case") == "decode_b32" and r["us"] == r["us"]]
    for r in sorted(dec, key=lambda r: r["us"])[:6]:
        log(f"  decode B32 S{r['page_size']:<3d} {r['tuning']:45s} {r['us']:8.1f} us {r['TBps']:.3f} TB/s {r['frac_bw']:.1%}")
    for r in rows:
        if r.get("case") in ("decode_b32_ref", "verify8_b32", "floor_b32"):
            log(f"  {r['label']:58s} {r['us']:8.1f} us {r['TBps']:.3f} TB/s")
    for label, v in b1.items():
        log(f"  verify8/decode B1 ctx4096 {label:24s} {v['q1_us']:6.2f} / {v['q8_us']:6.2f} us = {v['ratio']:.3f} (GPU time)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0 if RESULTS["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
