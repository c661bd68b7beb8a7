"""FP8 projections through ops.linear (the engine's XLA path for FP8 weights) against bf16:
GPU time per call of each Llama-3.1-8B layer projection at a few row counts.

    PYTHONPATH=.:scripts python3 scripts/bench_fp8_linear.py            # H200
    PYTHONPATH=.:scripts python3 scripts/bench_fp8_linear.py --quick    # CPU smoke (tiny shapes)

Forms, each from jspec/ops.py's linear: the bf16 weight; FP8 per output channel (the scale on
the f32 result); FP8 in 128 x 128 blocks (its row blocks' dots up to ops.FP8_BLOCK_DOT_ROWS
rows, dequantized first beyond); and the per-channel weight dequantized before its dot (the
form before 7a0103a), for scale. Timing: the profiler's GPU time (scripts/gpu_trace.py) over
two rotating weight copies; the ideal: the weight's bytes at the run's bandwidth probe (the
FP8 forms' scales included). Results: $OUT/bench_fp8_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from bench_common import _probe_time, measure_bandwidth

from jspec import ops
from jspec.quantization import quantize_fp8

# (name, F, K): one Llama-3.1-8B layer's projections, fused as the engine holds them
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
TINY = [("qkv", 384, 256), ("down", 256, 512)]


def forms(w_bf16):
    ch, blk = quantize_fp8(w_bf16, None, "bfloat16"), quantize_fp8(w_bf16, (128, 128), "bfloat16")
    return {"bf16": (w_bf16, w_bf16.size * 2), "fp8 channel": (ch, ch.w.size + ch.scale.size * 4),
            "fp8 block 128": (blk, blk.w.size + blk.scale.size * 4),
            "fp8 channel dequantized first": (ch, ch.w.size + ch.scale.size * 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1,4,16,64,256")
    args = ap.parse_args()
    bw = measure_bandwidth(args.quick)["best_TBps"] * 1e12
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: bandwidth probe {bw / 1e12:.2f} TB/s", flush=True)
    plan, rows_out = ops.KernelPlan(), []
    for name, F, K in TINY if args.quick else LLAMA_8B:
        ws = [jax.random.normal(jax.random.PRNGKey(i), (F, K), jnp.float32).astype(jnp.bfloat16) * 0.02
              for i in range(2)]
        copies = [forms(w) for w in ws]
        for M in [int(r) for r in args.rows.split(",")]:
            x = jax.random.normal(jax.random.PRNGKey(7), (M, K), jnp.float32).astype(jnp.bfloat16)
            for form in copies[0]:
                deq = form.endswith("dequantized first")
                fn = jax.jit(lambda x, w, deq=deq: ops.linear(plan, x, w.dequantize() if deq else w))
                arg_sets = [(x, c[form][0]) for c in copies]
                jax.block_until_ready([fn(*a) for a in arg_sets])
                t = _probe_time(fn, arg_sets)
                nbytes = copies[0][form][1]
                row = dict(proj=name, F=F, K=K, rows=M, form=form, us=t * 1e6, ideal_us=nbytes / bw * 1e6)
                rows_out.append(row)
                print(f"{name:8s} [{F:5d}, {K:5d}] rows {M:3d} {form:30s} {t * 1e6:8.1f} us "
                      f"(its bytes at the probe {row['ideal_us']:6.1f} us: {row['ideal_us'] / (t * 1e6):5.1%})",
                      flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_fp8_linear.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, bandwidth=bw, rows=rows_out), f,
                      indent=1)


if __name__ == "__main__":
    main()
