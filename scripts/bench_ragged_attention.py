"""Ragged (flat token batch) paged attention on the GPU: correctness, then GPU time against
paged_attention_gpu's [B, Q] rows on the same KV.

Run on the H200:
    PYTHONPATH=.:scripts python3 scripts/bench_ragged_attention.py [--sweep]
(writes $OUT/ragged_attention.json when OUT is set). CPU smoke test of the script (the
checks only, kernel interpreted, small shapes):
    PYTHONPATH=.:scripts python scripts/bench_ragged_attention.py --smoke

1. kernel == jnp reference on random mixes (decode, verify-8, prefill chunks, DFlash
   non-causal blocks, padding tokens, metadata rows past num_seqs), NaN-poisoned unused
   pages, bf16 GQA-4 and f32 GQA-1, a few tunings.
2. GPU time (the profiler's kernel records, scripts/gpu_trace.py: at batch 1 a call is
   ~10 us and wall clock would time the host) of: decode at batch 1 and 32, verify-8 at
   batch 1 and 32, and a mixed step (31 decodes + a 225-token prefill chunk), context 4096,
   32/8 heads, D 128, bf16, page 16. The comparator is paged_attention_gpu over [B, Q] rows
   (the mixed step: one call per segment, as the engine runs it today). Every timed set
   has its own pages (NSETS x the KV > the 50 MB L2 at batch 1). Printed: GPU time and KV
   bytes (each sequence's keys and values read once) per second.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention_gpu import paged_attention_gpu
from kernels_pallas.ragged_paged_attention import ref_ragged_paged_attention
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu

SMOKE = "--smoke" in sys.argv
NSETS = 8
SCALE = 128**-0.5
RESULTS: dict = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- 1. correctness
def random_step(rng, segments, *, T, N, kvh, group, S, D, dtype):
    """Arguments of ragged_paged_attention for segments [(q_len, kv_len, causal)], with
    poisoned junk (the scheme of tests/kernels/test_ragged_paged_attention.py)."""
    ns = len(segments)
    q_lens = np.array([s[0] for s in segments])
    kv = np.array([s[1] for s in segments], np.int32)
    pages = -(-kv // S)
    W = int(pages.max()) + 2
    P = int(pages.sum()) + 7
    perm = rng.permutation(P)
    owned, junk = perm[: pages.sum()], perm[pages.sum():]
    table = rng.choice(junk, size=(N, W)).astype(np.int32)
    offs = np.concatenate([[0], np.cumsum(pages)])
    for i in range(ns):
        table[i, : pages[i]] = owned[offs[i]: offs[i + 1]]
    k = rng.standard_normal((P, S, kvh, D)).astype(np.float32)
    v = rng.standard_normal((P, S, kvh, D)).astype(np.float32)
    k[junk] = v[junk] = np.nan
    for i in range(ns):
        last = table[i, pages[i] - 1] if pages[i] else None
        if last is not None and kv[i] % S:
            k[last, kv[i] % S:] = v[last, kv[i] % S:] = np.nan
    cu = np.full(N + 1, T + 5, np.int32)
    cu[: ns + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_all = np.full(N, 10**6, np.int32)
    kv_all[:ns] = kv
    causal = rng.random(N) < 0.5
    causal[:ns] = [s[2] for s in segments]
    q = rng.standard_normal((T, kvh * group, D)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(cu), jnp.asarray(kv_all),
            jnp.asarray(table), jnp.asarray([ns], jnp.int32), jnp.asarray(causal))


def check_mixes(rng, big):
    """name -> (segments, T, N); kv lengths up to ~600 (GPU) or ~80 (smoke)."""
    m = 600 if big else 80
    dec = [(1, int(rng.integers(1, m)), True) for _ in range(12)]
    ver = [(8, int(rng.integers(8, m)), True) for _ in range(6)]
    mixed = [(1, int(rng.integers(1, m)), True) for _ in range(5)] + [(48, 48, True), (8, m // 2, False), (0, 7, True),
                                                                        (33, m, True), (8, 40, True), (3, 2, True)]
    return {"decode": (dec, 16, 16), "verify8": (ver, 56, 8), "mixed": (mixed, 128, 16)}


def check_correctness():
    rng = np.random.default_rng(0)
    variants = [dict(), dict(kv_splits=1), dict(block_q=1), dict(block_q=4, block_kv=128, kv_splits=5),
                dict(block_kv=32, num_warps=8, num_stages=3)]
    if SMOKE:
        variants = variants[:2]
    configs = ((jnp.bfloat16, 4, 8, 2e-2), (jnp.float32, 1, 4, 2e-5))
    rows, ok = [], True
    for dtype, group, kvh, tol in configs:
        for name, (segs, T, N) in check_mixes(rng, not SMOKE).items():
            args = random_step(rng, segs, T=T, N=N, kvh=2 if SMOKE else kvh, group=group, S=16, D=128, dtype=dtype)
            with jax.default_matmul_precision("highest"):  # no TF32 in the f32 reference
                ref = jax.jit(ref_ragged_paged_attention, static_argnames="sm_scale")(*args, sm_scale=SCALE)
            ref = np.asarray(ref, np.float64)
            for var in variants:
                try:
                    out = np.asarray(ragged_paged_attention_gpu(*args, sm_scale=SCALE, interpret=SMOKE, **var), np.float64)
                    finite = bool(np.isfinite(out).all())
                    err = float(np.linalg.norm(np.nan_to_num(out - ref, nan=1e9)) / np.linalg.norm(ref))
                    good = finite and err < tol
                except Exception as e:  # keep going: one device call must report everything
                    finite, err, good = False, float("nan"), False
                    log(f"FAIL {name} {jnp.dtype(dtype).name} {var}: {type(e).__name__}: {str(e)[:2000]}")
                    traceback.print_exc(limit=3)
                ok &= good
                rows.append(dict(mix=name, dtype=jnp.dtype(dtype).name, group=group, variant=str(var), rel_err=err,
                                 finite=finite, ok=good))
                log(f"check {name:8s} {jnp.dtype(dtype).name:8s} G={group} {str(var):50s} rel_err={err:.2e} "
                    f"finite={finite} {'ok' if good else 'FAIL'}")
    RESULTS["correctness"], RESULTS["correct"] = rows, ok
    return ok


# ---------------------------------------------------------------- 2. GPU time
def timing_sets(segments, *, kvh=8, H=32, D=128, S=16, dtype=jnp.bfloat16):
    """NSETS steps over one cache, each on its own pages. segments: [(q_len, kv_len)].
    Returns (ragged arg sets, [B, Q] arg sets per group of equal q_len, KV bytes per step)."""
    rng = np.random.default_rng(len(segments) * 7 + segments[-1][0])
    q_lens = np.array([s[0] for s in segments])
    kv = np.array([s[1] for s in segments], np.int32)
    pages = kv // S
    W, per_set = int(pages.max()), int(pages.sum())
    key = jax.random.key(int(q_lens.sum()))
    k = jax.random.normal(key, (NSETS * per_set, S, kvh, D), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), (NSETS * per_set, S, kvh, D), dtype)
    N, T = len(segments), int(q_lens.sum())
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    ragged, rows = [], []
    for i in range(NSETS):
        ids = i * per_set + rng.permutation(per_set)
        table = np.zeros((N, W), np.int32)
        offs = np.concatenate([[0], np.cumsum(pages)])
        for b in range(N):
            table[b, : pages[b]] = ids[offs[b]: offs[b + 1]]
        q = jax.random.normal(jax.random.fold_in(key, 2 + i), (T, H, D), dtype)
        ragged.append((q, k, v, cu, jnp.asarray(kv), jnp.asarray(table), jnp.asarray([N], jnp.int32),
                       jnp.ones((N,), bool)))
        groups = []
        for ql in sorted(set(q_lens.tolist())):  # the engine's segments: rows of equal q_len
            sel = np.nonzero(q_lens == ql)[0]
            qs = jnp.concatenate([q[int(cu[b]): int(cu[b]) + ql][None] for b in sel])  # [B, Q, H, D]
            pos = (kv[sel] - ql)[:, None] + np.arange(ql)[None]
            groups.append((qs, k, v, jnp.asarray(table[sel]), jnp.asarray(kv[sel]), jnp.asarray(pos.astype(np.int32)),
                           jnp.ones((len(sel),), bool)))
        rows.append(groups)
    kv_bytes = int(kv.sum()) * kvh * D * 2 * jnp.dtype(dtype).itemsize
    return ragged, rows, kv_bytes


CASES = {  # name -> segments (q_len, kv_len)
    "decode B1": [(1, 4096)],
    "decode B32": [(1, 4096)] * 32,
    "verify8 B1": [(8, 4096)],
    "verify8 B32": [(8, 4096)] * 32,
    "mixed 31 decode + prefill 225": [(1, 4096)] * 31 + [(225, 2048)],
}


def gpu_times(sweep):
    from gpu_trace import device_times

    out = []
    for name, segs in CASES.items():
        ragged, rows, kv_bytes = timing_sets(segs)
        paged = jax.jit(lambda groups: [paged_attention_gpu(*g, sm_scale=SCALE) for g in groups])
        t_paged = device_times(paged, [(g,) for g in rows], reps=5)["busy_us"]
        tunings = [{}] + ([dict(kv_splits=s) for s in (1, 2, 4, 8)] + [dict(block_q=1), dict(block_q=16)] if sweep else [])
        for tun in tunings:
            fn = jax.jit(lambda *a, tun=tun: ragged_paged_attention_gpu(*a, sm_scale=SCALE, **tun))
            try:
                t = device_times(fn, ragged, reps=5)["busy_us"]
            except Exception as e:  # a tuning the lowering rejects: report, go on
                log(f"FAIL {name} {tun}: {type(e).__name__}: {str(e)[:500]}")
                continue
            row = dict(case=name, tuning=str(tun), ragged_us=t, paged_us=t_paged, kv_bytes=kv_bytes,
                       ragged_TBps=kv_bytes / t / 1e6, paged_TBps=kv_bytes / t_paged / 1e6)
            out.append(row)
            log(f"time {name:30s} {str(tun):18s} ragged {t:8.2f} us {row['ragged_TBps']:5.2f} TB/s | "
                f"paged [B,Q] {t_paged:8.2f} us {row['paged_TBps']:5.2f} TB/s | ragged/paged {t / t_paged:.2f}")
        del ragged, rows
    RESULTS["timings"] = out
    return out


def main():
    log(f"jax {jax.__version__}, devices {jax.devices()}")
    ok = check_correctness()
    if not SMOKE:
        timings = gpu_times("--sweep" in sys.argv)
        log(f"\n=== summary ({RESULTS['device']}, jax {jax.__version__}) === correct on GPU: {ok}")
        for r in timings:
            if r["tuning"] == "{}":
                log(f"  {r['case']:30s} ragged {r['ragged_us']:8.2f} us ({r['ragged_TBps']:.2f} TB/s)  "
                    f"paged [B,Q] {r['paged_us']:8.2f} us ({r['paged_TBps']:.2f} TB/s)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ragged_attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
