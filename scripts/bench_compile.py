"""Compile time of each step program warmup prepares, one at a time (issues 57 and 60): which
shapes cost the startup, and what in them (FP8 GEMMs, cuBLAS calls, Pallas kernels).

An engine like bench_throughput's (random weights, the Llama-3.1-8B shape; --quantization /
--kv-cache-dtype / --weight-only as a user sets them), no warmup; then every shape of its warmup
(``jspec.engine.warmup.warmup_calls``: the general token buckets and the decode family) is
lowered and compiled here in turn, jspec's and jax's compilation caches off, and timed. Each
row: the shape (tokens, sequences, steps, decode, filtering), seconds to lower and to compile,
and what the compiled program calls (cuBLAS GEMMs, FP8 ones among them, custom kernels).
Slowest first, with the sum against warmup's threads in the engine.

    PYTHONPATH=.:scripts python3 scripts/bench_compile.py                                     # bf16
    PYTHONPATH=.:scripts python3 scripts/bench_compile.py --quantization fp8 [--weight-only] [--kv-cache-dtype fp8]
    PYTHONPATH=.:scripts python3 scripts/bench_compile.py --quick                             # CPU smoke run

Extra XLA flags (autotuning's, say) go in XLA_FLAGS as usual. Results: $OUT/bench_compile.json
when OUT is set (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time


def program_calls(hlo: str) -> dict:
    """What a compiled program's text calls: cuBLAS GEMMs (FP8 ones counted apart), other
    custom calls (Pallas / Triton kernels), fusions XLA made."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    gemms = [t for t in targets if t.startswith("__cublas")]
    return dict(cublas_gemms=len(gemms), fp8_gemms=sum("$f8" in t for t in gemms),
                custom_kernels=len(targets) - len(gemms), fusions=len(re.findall(r"= \S+ fusion\(", hlo)))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None)
    ap.add_argument("--weight-only", action="store_true", help="JSPEC_FP8_GEMM=0: FP8 weights' GEMMs beyond 16 rows "
                    "weight-only, not W8A8 (the default where the checkpoint asks for FP8 activations)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=1024 + 256 + 16)
    ap.add_argument("--min-tokens", type=int, default=0, help="only shapes of at least this many tokens")
    ap.add_argument("--limit", type=int, default=0, help="at most this many shapes (the largest first; 0: all)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # before jax or jspec read them: every program compiled here, none loaded from a cache
    os.environ["JSPEC_COMPILATION_CACHE"] = "0"
    if args.weight_only:
        os.environ["JSPEC_FP8_GEMM"] = "0"
    import jax
    from bench_common import LLAMA_8B, TINY
    from bench_llm_folders import write_target_folder

    import jspec
    from jspec.engine.warmup import lower_shape

    cfg = TINY if args.quick else LLAMA_8B
    if args.quick:
        args.max_num_seqs, args.max_model_len = 4, 64
    tdir = write_target_folder(tempfile.mkdtemp(prefix="jspec_bench_compile_"), cfg)
    kw = dict(dtype="bfloat16", load_format="dummy", max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens, warmup=False)
    kw.update({k: v for k in ("quantization", "kv_cache_dtype") if (v := getattr(args, k)) is not None})
    if args.quick:
        kw["num_pages"] = 64
    llm = jspec.LLM(tdir, **kw)
    eng = llm.engine
    r = eng.runner
    print(f"{jax.devices()[0].device_kind}: plan fp8_gemm={r.plan.fp8_gemm}, KV {r.kv.k[0].dtype}, "
          f"threads {r.plan.compile_threads}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    shapes = [sh for sh in eng.warmup_shapes() if sh.tokens >= args.min_tokens]
    shapes.sort(key=lambda sh: -sh.tokens)
    shapes = shapes[: args.limit] if args.limit else shapes
    rows = []
    for sh in shapes:
        t = time.perf_counter()
        lowered = lower_shape(r, sh)
        t_lower = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        t_compile = time.perf_counter() - t
        row = dict(shape=list(sh), lower_s=t_lower, compile_s=t_compile, **program_calls(compiled.as_text()))
        rows.append(row)
        print(f"  {tuple(sh)}: lower {t_lower:5.1f} s, compile {t_compile:6.1f} s; {row['cublas_gemms']} cuBLAS "
              f"GEMMs ({row['fp8_gemms']} FP8), {row['custom_kernels']} custom kernels, {row['fusions']} fusions",
              flush=True)
    total = sum(x["compile_s"] for x in rows)
    print(f"{len(rows)} shapes: {total:.1f} s of compiling one at a time ({sum(x['lower_s'] for x in rows):.1f} s "
          f"lowering); slowest: " + ", ".join(f"{tuple(x['shape'][:2])} {x['compile_s']:.1f} s"
                                              for x in sorted(rows, key=lambda x: -x["compile_s"])[:5]), flush=True)
    out = args.json or (os.path.join(os.environ["OUT"], "bench_compile.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
                           fp8_gemm=r.plan.fp8_gemm, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
