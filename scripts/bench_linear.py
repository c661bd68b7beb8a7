"""Fused small-batch projections and RoPE + KV write on the GPU: kernel == reference, and
GPU time of each Llama-3.1-8B layer projection, fused kernel vs the unfused XLA ops.

    PYTHONPATH=.:scripts python scripts/bench_linear.py            # H200
    PYTHONPATH=.:scripts python scripts/bench_linear.py --quick    # CPU smoke test (interpret)
    PYTHONPATH=.:scripts python scripts/bench_linear.py --rows 16 --sweep   # fused_linear_rows at 16 rows, its tiles
    PYTHONPATH=.:scripts python scripts/bench_linear.py --fp8 [--sweep]     # FP8 weights, per-channel scales

Timing is profiler GPU time (scripts/gpu_trace.py) over 4 rotating weight copies, so no
weight is read from L2; bytes counted are the weight's. Results: $OUT/bench_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import ops
from jspec.quantization import QuantWeight, quantize_fp8
from kernels_pallas.fused_linear import fused_linear, fused_linear_gpu, ref_fused_linear
from kernels_pallas.fused_linear_rows import fused_linear_rows, fused_linear_rows_gpu, ref_fused_linear_rows
from kernels_pallas.fused_linear_split_k import fused_linear_split_k_gpu
from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write, ref_qkv_rope_kv_write
from kernels_pallas.rope_kv_write import ref_rope_kv_write, rope_kv_write, rope_tables

# (name, F, K, prologue, residual): the projections of one Llama-3.1-8B layer + lm_head
LLAMA_8B = [("qkv", 6144, 4096, "rmsnorm", False), ("o", 4096, 4096, "none", True),
            ("gate_up", 28672, 4096, "rmsnorm", False), ("down", 4096, 14336, "silu_mul", True),
            ("lm_head", 128256, 4096, "none", False)]
# Narrower models, where the tiles tuned on the 8B shapes leave SMs idle (fewer programs than SMs):
# Qwen3-30B-A3B's attention (hidden 2048, 32 x 128 query heads, 4 kv heads; its MLP is the
# experts, kernels_pallas/moe_experts.py) and Llama-3.2-1B's layer.
QWEN3_30B_A3B = [("qkv", 5120, 2048, "rmsnorm", False), ("o", 2048, 4096, "none", True)]
LLAMA_1B = [("qkv", 3072, 2048, "rmsnorm", False), ("o", 2048, 2048, "none", True),
            ("gate_up", 16384, 2048, "rmsnorm", False), ("down", 2048, 8192, "silu_mul", True)]
# One device's shards of a Llama-3.3-70B (Llama-3.1-8B) layer at tensor parallel 2 (per_shard_layer): q|k|v and
# gate|up split by output, o and down by input (their outputs partial sums, f32).
LLAMA_70B_TP2 = [("qkv", 5120, 8192, "rmsnorm", False), ("o", 8192, 4096, "none", True),
                 ("gate_up", 28672, 8192, "rmsnorm", False), ("down", 8192, 14336, "silu_mul", True)]
LLAMA_8B_TP2 = [("qkv", 3072, 4096, "rmsnorm", False), ("o", 4096, 2048, "none", True),
                ("gate_up", 14336, 4096, "rmsnorm", False), ("down", 4096, 7168, "silu_mul", True)]
LLAMA_70B = [("qkv", 10240, 8192, "rmsnorm", False), ("o", 8192, 8192, "none", True),
             ("gate_up", 57344, 8192, "rmsnorm", False), ("down", 8192, 28672, "silu_mul", True)]
# gpt-oss-20b / -120b's attention (hidden 2880, 64 x 64 query heads, 8 kv heads; their MLPs are the MXFP4
# experts, kernels_pallas/moe_experts_mxfp4.py): K = 2880 takes a masked last chunk
GPT_OSS = [("qkv", 5120, 2880, "rmsnorm", False), ("o", 2880, 4096, "none", True)]
SHAPES = {"gpt-oss": GPT_OSS, "llama-8b": LLAMA_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "llama-1b": LLAMA_1B, "llama-70b-tp2": LLAMA_70B_TP2,
          "llama-8b-tp2": LLAMA_8B_TP2, "llama-70b": LLAMA_70B}
HEADS = {"gpt-oss": (64, 8, 64), "llama-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128), "llama-1b": (32, 8, 64),
         "llama-70b-tp2": (32, 4, 128), "llama-8b-tp2": (16, 4, 128), "llama-70b": (64, 8, 128)}  # (H, KVH, D)
TINY = [("qkv", 256, 128, "rmsnorm", False), ("gate_up", 256, 128, "rmsnorm", False), ("down", 128, 256, "silu_mul", True), ("lm_head", 512, 128, "none", False)]


FP8 = False  # --fp8: every weight per-channel FP8 (QuantWeight), the kernels given its scale


def split(w):
    """(the array a kernel streams, its w_scale | None)."""
    return (w.w, w.scale.reshape(-1)) if isinstance(w, QuantWeight) else (w, None)


def weight_bytes(F, K):
    return F * K + F * 4 if FP8 else F * K * 2


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def linear_inputs(name, F, K, prologue, residual, M, copies):
    """x, `copies` weight copies and fused_linear's keyword arguments for one projection."""
    keys = jax.random.split(jax.random.PRNGKey(F + 7 * K + 131 * M), 8)
    kin = 2 * K if prologue == "silu_mul" else K
    x = jax.random.normal(keys[0], (M, kin), jnp.float32).astype(jnp.bfloat16)
    ws = [(0.02 * jax.random.normal(keys[1 + i], (F, K), jnp.float32)).astype(jnp.bfloat16) for i in range(copies)]
    ws = [quantize_fp8(w, None, "bfloat16") for w in ws] if FP8 else ws
    nw = (1 + 0.1 * jax.random.normal(keys[5], (K,), jnp.float32)).astype(jnp.bfloat16) if prologue == "rmsnorm" else None
    res = jax.random.normal(keys[6], (M, F), jnp.float32).astype(jnp.bfloat16) if residual else None
    out_dtype = jnp.float32 if name == "lm_head" else None
    return x, ws, dict(prologue=prologue, norm_w=nw, eps=1e-5, residual=res, out_dtype=out_dtype)


def linear_case(name, F, K, prologue, residual, M, interpret, quick, timing):
    """fused_linear (the kernel where the model's ops would run it, one row split over K where
    the device lists the shape, else XLA) vs the unfused reference; at one row also XLA on x
    padded to 8 rows (``xla_pad8``: XLA's GEMM in place of its one-row dot)."""
    x, ws, kw = linear_inputs(name, F, K, prologue, residual, M, 1 if quick else 4)
    plan = ops.KernelPlan(linear=ops.GPU(interpret))
    kernel = ops.linear_kernel(plan, M, (F, K), fused=prologue != "none" or residual,
                               dtype=split(ws[0])[0].dtype if M == 1 else None)  # (one row: the FP8 exceptions too)
    fused = jax.jit(lambda x, w: ops._fused_linear(plan, x, w, kernel=kernel, **kw))  # the model's routing, split-K too
    ref = jax.jit(lambda x, w: ref_fused_linear(x, split(w)[0], w_scale=split(w)[1], **kw))
    row = dict(name=name, F=F, K=K, prologue=prologue, residual=residual, M=M, kernel=kernel,
               rel_err=rel_err(fused(x, ws[0]), ref(x, ws[0])))
    fns = [("fused", fused), ("xla", ref)]
    if M == 1:
        pad = lambda a: None if a is None else jnp.pad(a, ((0, 7), (0, 0)))  # noqa: E731
        kw8 = dict(kw, residual=pad(kw["residual"]))
        fns.append(("xla_pad8", jax.jit(lambda x, w: ref_fused_linear(pad(x), split(w)[0], w_scale=split(w)[1],
                                                                      **kw8)[:1])))
        row["rel_err_pad8"] = rel_err(fns[-1][1](x, ws[0]), ref(x, ws[0]))
    if timing:
        time_into(row, fns, x, ws, weight_bytes(F, K))
    return row


def time_into(row, fns, x, ws, nbytes):
    """GPU time of each (label, fn(x, w)) over the rotating weights ws into row: label_us,
    label_TBps (nbytes streamed), label_kernels."""
    from gpu_trace import device_times
    for label, fn in fns:
        t = device_times(fn, [(x, w) for w in ws], reps=10)
        row[f"{label}_us"] = t["busy_us"]
        row[f"{label}_TBps"] = nbytes / t["busy_us"] / 1e6
        row[f"{label}_kernels"] = len(t["kernels_us"])


def sweep_case(name, F, K, prologue, residual):
    """GPU time of the kernel at other tilings (one row), best first: [(blocks, us | error, None)]."""
    from gpu_trace import time_tilings
    x, ws, kw = linear_inputs(name, F, K, prologue, residual, 1, 4)
    elementwise = [(bf, bd, warps, stages) for bf in (8, 16) for bd in (512, 1024, 2048) for stages in (2, 4)
                   for warps in (4, 8)]
    mma = [(bf, bd, 4, stages, True) for bf in (16, 32, 64, 128) for bd in (256, 512) + ((1024,) if FP8 else ())
           for stages in (3, 4, 5, 6)] + [(32, 256, 8, 4, True), (64, 256, 8, 4, True)]
    # FP8, no RMSNorm prologue: fused_linear_split_k's tiles too, (S, block_f, block_d, warps, stages, mma)
    split_k = [(S, bf, bd, 4, stages, True) for S in (2, 4, 8) for bf in (32, 64, 128) for bd in (256,)
               for stages in (3, 4) if K % (S * bd) == 0] if FP8 and prologue != "rmsnorm" else []

    def make(b):
        if len(b) == 6:
            return jax.jit(lambda x, w: fused_linear_split_k_gpu(
                x, split(w)[0], None, kw["residual"], prologue=prologue, eps=1e-5, blocks=b, w_scale=split(w)[1]))
        return jax.jit(lambda x, w: fused_linear_gpu(
            x, split(w)[0], kw["norm_w"], None, kw["residual"], prologue=prologue, eps=1e-5, blocks=b,
            w_scale=split(w)[1]))
    return time_tilings(make, elementwise + mma + split_k, [(x, w) for w in ws])


def rows_case(name, F, K, prologue, residual, M, interpret, timing, sweep=False):
    """R = M rows (a verification step's K + 1) as the model's ops run them through
    fused_linear_rows: qkv and gate_up on a handed-over input norm (x * w_norm and sums of
    x^2), o_proj and down_proj + residual handing the next norm over; down's input is
    SwiGLU's output, which gate_up's kernel writes. Against XLA doing the same
    (ref_fused_linear_rows). sweep: GPU time of other tiles, best first."""
    x, ws, kw = linear_inputs(name, F, K, "none", residual, M, 4)
    kw = dict(eps=1e-5, residual=kw["residual"], out_dtype=kw["out_dtype"])
    if prologue == "rmsnorm":  # the input norm handed over
        kw["sumsq"] = jnp.sum(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True)
    elif residual:
        kw["next_norm_w"] = jnp.ones((F,), jnp.bfloat16)
    swiglu = name == "gate_up"  # with SwiGLU in its epilogue
    kernel = jax.jit(lambda x, w: fused_linear_rows(x, split(w)[0], interpret=interpret, swiglu=swiglu,
                                                    w_scale=split(w)[1], **kw))
    ref = jax.jit(lambda x, w: ref_fused_linear_rows(x, split(w)[0], swiglu=swiglu, w_scale=split(w)[1], **kw))
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731
    row = dict(name=name, F=F, K=K, prologue=prologue, residual=residual, M=M, kwargs=sorted(k for k in kw if kw[k] is not None),
               rel_err=rel_err(first(kernel(x, ws[0])), first(ref(x, ws[0]))))
    if timing:
        from gpu_trace import time_tilings
        time_into(row, (("kernel", kernel), ("xla", ref)), x, ws, weight_bytes(F, K))
        if sweep:
            tiles = [(bf, bd, 4, st) for bf in (16, 32, 64) for bd in (128, 256, 512) for st in (3, 5)] + \
                [(32, 256, 8, 4), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3), (32, 128, 4, 8)]
            row["sweep"] = time_tilings(lambda b: jax.jit(lambda x, w: fused_linear_rows_gpu(
                x, split(w)[0], None, kw["residual"], eps=1e-5, w_scale=split(w)[1], blocks=b, sumsq=kw.get("sumsq"), next_norm_w=kw.get("next_norm_w"),
                out_dtype=None if kw["out_dtype"] is None else "float32", swiglu=swiglu)), tiles, [(x, w) for w in ws])
    return row


def rope_case(H, KVH, D, M, qk_norm, interpret, timing):
    keys = jax.random.split(jax.random.PRNGKey(M + 7 * H), 6)
    P, S = 256, 16
    qkv = jax.random.normal(keys[0], (M, (H + 2 * KVH) * D), jnp.float32).astype(jnp.bfloat16)
    kp = jax.random.normal(keys[1], (P, S, KVH, D), jnp.float32).astype(jnp.bfloat16)
    vp = jax.random.normal(keys[2], (P, S, KVH, D), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.arange(M, dtype=jnp.int32) * 37 + 500
    slot = jnp.where(jnp.arange(M) % 5 == 4, P * S, (jnp.arange(M) * 13) % (P * S)).astype(jnp.int32)
    cos, sin = rope_tables(pos, 1.0 / (500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    norms = [(1 + 0.1 * jax.random.normal(keys[3 + i], (D,), jnp.float32)).astype(jnp.bfloat16) for i in range(2)] \
        if qk_norm else [None, None]
    fn = jax.jit(lambda kp, vp: rope_kv_write(qkv, cos, sin, slot, kp, vp, *norms, num_heads=H, eps=1e-6, interpret=interpret))
    ref = ref_rope_kv_write(qkv, cos, sin, slot, kp, vp, *norms, num_heads=H, eps=1e-6)
    got = fn(kp, vp)
    row = dict(H=H, KVH=KVH, D=D, M=M, qk_norm=qk_norm,
               q_err=rel_err(got[0], ref[0]), k_err=rel_err(got[1], ref[1]), v_err=rel_err(got[2], ref[2]))
    if timing:
        from gpu_trace import device_times
        row["fused_us"] = device_times(fn, [(kp, vp)], reps=20)["busy_us"]
        refj = jax.jit(lambda kp, vp: ref_rope_kv_write(qkv, cos, sin, slot, kp, vp, *norms, num_heads=H, eps=1e-6))
        row["xla_us"] = device_times(refj, [(kp, vp)], reps=20)["busy_us"]
    return row


def qkv_rope_case(H, KVH, D, K, interpret, timing, copies=4, sweep=False):
    """One token: norm + qkv + RoPE + KV write in one kernel vs the two kernels (projection,
    then RoPE + KV write) and vs the XLA reference; ``copies`` rotating weights. sweep: also
    time other tiles of the one kernel (qkv_rope_kv_write.kernel_blocks)."""
    keys = jax.random.split(jax.random.PRNGKey(K + H), 8)
    P, S = 8, 16  # small: the undonated caches are copied (~0.5 us each), in both timings
    F = (H + 2 * KVH) * D
    ws = [(0.02 * jax.random.normal(jax.random.fold_in(keys[0], i), (F, K), jnp.float32)).astype(jnp.bfloat16)
          for i in range(copies)]
    ws = [quantize_fp8(w, None, "bfloat16") for w in ws] if FP8 else ws
    x = jax.random.normal(keys[1], (1, K), jnp.float32).astype(jnp.bfloat16)
    nw = (1 + 0.1 * jax.random.normal(keys[2], (K,), jnp.float32)).astype(jnp.bfloat16)
    kp = jax.random.normal(keys[3], (P, S, KVH, D), jnp.float32).astype(jnp.bfloat16)
    vp = jax.random.normal(keys[4], (P, S, KVH, D), jnp.float32).astype(jnp.bfloat16)
    cos, sin = rope_tables(jnp.array([517]), 1.0 / (500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    slot = jnp.array([101], jnp.int32)
    one = jax.jit(lambda w, kp, vp: qkv_rope_kv_write(x, split(w)[0], nw, None, cos, sin, slot, kp, vp, num_heads=H,
                                                       eps=1e-5, interpret=interpret, w_scale=split(w)[1]))

    def two_fn(w, kp, vp):
        qkv = fused_linear(x, split(w)[0], prologue="rmsnorm", norm_w=nw, eps=1e-5, interpret=interpret,
                           w_scale=split(w)[1])
        return rope_kv_write(qkv, cos, sin, slot, kp, vp, num_heads=H, eps=1e-5, interpret=interpret)

    two = jax.jit(two_fn)
    got, pair = one(ws[0], kp, vp), two(ws[0], kp, vp)
    ref = ref_qkv_rope_kv_write(x, split(ws[0])[0], nw, None, cos, sin, slot, kp, vp, num_heads=H, eps=1e-5,
                                w_scale=split(ws[0])[1])
    row = dict(H=H, KVH=KVH, D=D, K=K, err_vs_reference=max(rel_err(a, b) for a, b in zip(got, ref)),
               err_vs_two_kernels=max(rel_err(a, b) for a, b in zip(got, pair)))
    if timing:
        from gpu_trace import device_times
        args = [(w, kp, vp) for w in ws]
        row["one_kernel_us"] = device_times(one, args, reps=20)["busy_us"]
        row["two_kernels_us"] = device_times(two, args, reps=20)["busy_us"]
        if sweep:
            from gpu_trace import time_tilings

            from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write_gpu
            tiles = ([(4, 512, 4, 4, False), (8, 1024, 4, 4, False), (4, 2048, 8, 4, False)]
                     # narrower weights (gpt-oss's [5120, 2880]): fewer rows a program, more programs
                     + [(2, 512, 4, 4, False), (2, 1024, 4, 4, False), (4, 1024, 4, 4, False), (4, 512, 8, 4, False),
                        (4, 1024, 4, 2, False), (8, 512, 4, 4, False)]
                     + [(p, bd, 4, st, True) for p in (8, 16, 32) for bd in (256, 512, 1024) for st in (3, 4)]
                     # around the K >= 8192 row (2 x 32 rows x 512, 4 stages): deeper, wider, 8 warps, 2 x 64 rows
                     + [(32, 256, 4, 5, True), (32, 256, 4, 6, True), (32, 512, 8, 4, True), (32, 256, 8, 4, True),
                        (64, 256, 4, 3, True), (64, 256, 4, 4, True)])
            row["sweep"] = time_tilings(
                lambda b: jax.jit(lambda w, kp, vp: qkv_rope_kv_write_gpu(x, split(w)[0], nw, None, cos, sin, slot, kp,
                                                                          vp, num_heads=H, eps=1e-5, blocks=b,
                                                                          w_scale=split(w)[1])),
                tiles, args, reps=10, check=lambda fn: max(rel_err(a, c) for a, c in zip(fn(ws[0], kp, vp), ref)))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--sweep", action="store_true", help="also time other tilings of the layer projections (GPU)")
    ap.add_argument("--qkv-rope-only", action="store_true", help="only the qkv + RoPE + KV-write kernel (with --sweep:"
                    " its tiles)")
    ap.add_argument("--rows", default="", help="fused_linear_rows at these row counts (e.g. 4,8,16) instead; with "
                    "--sweep: its tiles at the last count")
    ap.add_argument("--shapes", default="llama-8b", choices=sorted(SHAPES), help="the layer's projections to time")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights, per output channel (the lm_head too, here)")
    args = ap.parse_args()
    global FP8
    FP8 = args.fp8
    gpu = jax.default_backend() == "gpu"
    interpret = not gpu  # the kernels' bodies in Pallas' interpreter off the GPU
    out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "fp8": FP8, "linear": [], "rope": []}
    shapes = TINY if args.quick or not gpu else SHAPES[args.shapes]
    if args.rows:
        counts = [int(r) for r in args.rows.split(",")]
        out["rows"] = []
        for name, F, K, pro, res in shapes:
            for M in counts:
                r = rows_case(name, F, K, pro, res, M, interpret, gpu, sweep=args.sweep and gpu and M == counts[-1] and name != "lm_head")
                out["rows"].append(r)
                t = "".join(f" {k[:-3]} {v:.1f} us ({r[k[:-3] + '_TBps']:.2f} TB/s)" for k, v in r.items()
                            if k.endswith("_us"))
                print(f"rows {name:8s} M={M:2d} {pro:8s} res={int(res)} err {r['rel_err']:.2e}{t}", flush=True)
                for b, us, _ in r.get("sweep", [])[:8]:
                    print(f"  tiles {b}: {us if isinstance(us, str) else f'{us:.2f} us'}", flush=True)
        dest = os.environ.get("OUT")
        if dest:
            with open(os.path.join(dest, f"bench_linear_rows{'_fp8' if FP8 else ''}.json"), "w") as f:
                json.dump(out, f, indent=1)
        return
    for name, F, K, pro, res in ([] if args.qkv_rope_only else shapes):
        for M in (1, 8):  # M > 1 (and shapes ops.linear_kernel keeps with XLA) run XLA: kernel=0, for contrast
            r = linear_case(name, F, K, pro, res, M, interpret, args.quick, timing=gpu)
            out["linear"].append(r)
            t = f" fused {r['fused_us']:7.1f} us ({r['fused_TBps']:.2f} TB/s) xla {r['xla_us']:7.1f} us " \
                f"({r['xla_TBps']:.2f} TB/s, {r['xla_kernels']} kernels)" if gpu else ""
            t += f" xla padded to 8 rows {r['xla_pad8_us']:7.1f} us" if gpu and M == 1 else ""
            print(f"linear {name:8s} M={M:2d} {pro:8s} res={int(res)} kernel={int(r['kernel'])} "
                  f"err {r['rel_err']:.2e}{t}", flush=True)
    if args.sweep and gpu and not args.qkv_rope_only:
        out["sweep"] = []
        for name, F, K, pro, res in shapes[:4]:
            sw = sweep_case(name, F, K, pro, res)
            out["sweep"].append(dict(name=name, F=F, K=K, prologue=pro, sweep=sw))
            print(f"sweep {name}: " + ", ".join(f"{b} {us:.1f}" if isinstance(us, float) else f"{b} {us}"
                                                 for b, us, _ in sw[:6]), flush=True)
    heads = [(4, 2, 32)] if args.quick or not gpu else [HEADS[args.shapes]]
    for H, KVH, D in heads:
        for M in (() if args.qkv_rope_only else (1, 8, 64)):
            for qk in (False, True):
                r = rope_case(H, KVH, D, M, qk, interpret, timing=gpu)
                out["rope"].append(r)
                t = f" fused {r['fused_us']:.1f} us xla {r['xla_us']:.1f} us" if gpu else ""
                print(f"rope H={H} KVH={KVH} D={D} M={M:2d} qk_norm={int(qk)} err q {r['q_err']:.1e} "
                      f"k {r['k_err']:.1e} v {r['v_err']:.1e}{t}", flush=True)
    K = 128 if args.quick or not gpu else SHAPES[args.shapes][0][2]  # qkv's input width
    for H, KVH, D in heads:
        r = qkv_rope_case(H, KVH, D, K, interpret, timing=gpu, sweep=args.sweep and gpu)
        out["qkv_rope"] = r
        t = f" one kernel {r['one_kernel_us']:.1f} us, two kernels {r['two_kernels_us']:.1f} us" if gpu else ""
        print(f"qkv+rope H={H} KVH={KVH} D={D} K={K} err vs reference {r['err_vs_reference']:.1e}, "
              f"vs the two kernels {r['err_vs_two_kernels']:.1e}{t}", flush=True)
        for b, us, err in r.get("sweep", []):
            print(f"  qkv+rope tiles {b}: {us if isinstance(us, str) else f'{us:.2f} us'} err {err}", flush=True)
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, f"bench_linear{'_fp8' if FP8 else ''}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
