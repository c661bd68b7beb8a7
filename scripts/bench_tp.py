"""Tensor-parallel decode throughput (issue 29): jspec.LLM at each tensor_parallel_size of
--tps, plain and with a drafter, at batch sizes --batches.

Random bf16 weights (load_format="dummy": folders holding only config.json, written by
scripts/bench_llm_folders.py), prompts of --ctx random tokens, --new greedy tokens, timed
through LLM.generate with the prefill subtracted (a 1-token run of the same prompts;
bench.py's llm_run). The drafter runs with synthetic acceptance (random weights accept
nothing): --length tokens per verification on average. Each row is printed next to the
bandwidth bound of one device: (its share of the non-embedding weights + the KV it reads
per step) / one device's HBM bandwidth measured in the same run (bench.py's
measure_bandwidth); a speculative row's bound is the plain bound times the acceptance length.

    python scripts/bench_tp.py --model llama-8b --tps 1,2,4,8            # one host, up to 8 GPUs
    python scripts/bench_tp.py --model llama-70b --tps 4,8 --methods eagle3
    python scripts/bench_tp.py --quick --tps 1,2 --cpu-devices 2         # CPU smoke test
Results go to $OUT/bench_tp.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b", choices=["llama-8b", "qwen3-8b", "llama-70b"])
    ap.add_argument("--tps", default="1,2", help="tensor parallel sizes")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default="eagle3", help="drafters ('' for plain only): eagle3, peagle, dflash")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens (DFlash: its block - 1, 15)")
    ap.add_argument("--length", type=float, default=2.5, help="synthetic mean acceptance length")
    ap.add_argument("--draft-tp", default="same", choices=["same", "1"], help="draft_tensor_parallel_size")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--cpu-devices", type=int, default=0, help="virtual CPU devices (set before jax starts)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # bench.py's helpers; this checkout's jspec
    import jax
    import numpy as np
    from bench import LLAMA_8B, QWEN3_8B, TINY, drafter_config, llm_run, measure_bandwidth
    from bench_llm_folders import write_folders

    import jspec
    from jspec import parallel

    llama_70b = dataclasses.replace(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                    num_heads=64, num_kv_heads=8)
    cfg = TINY if args.quick else {"llama-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B, "llama-70b": llama_70b}[args.model]
    ctx, new = (32, 16) if args.quick else (args.ctx, args.new)
    batches = [int(b) for b in args.batches.split(",")]
    tps = [int(t) for t in args.tps.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    bw = measure_bandwidth(args.quick)["best_TBps"] * 1e12  # one device
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, {bw / 1e12:.2f} TB/s per device; "
          f"{args.model if not args.quick else 'tiny'}, ctx {ctx}, {new} new tokens", flush=True)
    root, rng, rows = tempfile.mkdtemp(prefix="jspec_bench_tp_"), np.random.default_rng(0), []
    num_pages = max(batches) * (-(-(ctx + new + 128) // 16) + 2) + 8
    common = dict(dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches), enable_prefix_caching=False,
                  max_model_len=ctx + new + 96, num_pages=num_pages)
    for tp in tps:
        plain_bound = {}
        for method in [None] + methods:
            dc = drafter_config(method or "eagle3", cfg, args.quick)
            K = dc.block_size - 1 if method == "dflash" else args.k
            tdir, ddir = write_folders(os.path.join(root, method or "plain"), cfg, dc, K)
            spec = None if method is None else {
                "method": method, "model": ddir, "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_length": args.length,
                "draft_tensor_parallel_size": tp if args.draft_tp == "same" else 1}
            try:
                llm = jspec.LLM(tdir, speculative_config=spec, tensor_parallel_size=tp, **common)
            except ValueError as e:  # a size that does not split this shape: say so, go on
                print(f"tp={tp} {method or 'plain'}: {e}", flush=True)
                continue
            eng = llm.engine
            dev0 = jax.devices()[0]
            wbytes = parallel.device_param_bytes(eng.runner.params)[dev0]
            wbytes -= eng.runner.params["embed_tokens"]["embedding"].nbytes // tp  # gathered rows only
            kv_row = 2 * cfg.num_layers * parallel.local_kv_heads(cfg.num_kv_heads, tp) * cfg.head_dim * 2
            for B in batches:
                if spec is not None:
                    eng.spec_metrics.__init__()
                tot, pf = llm_run(llm, B, ctx, new, rng)
                step_s = (tot - pf) / (new - 1)
                tok_s = B * (new - 1) / (tot - pf)
                bound = B / ((wbytes + B * (ctx + new // 2) * kv_row) / bw)
                tau = eng.spec_metrics.mean_acceptance_length if spec is not None else 1.0
                if spec is None:
                    plain_bound[B] = bound
                bound = plain_bound.get(B, bound) * tau
                row = dict(tp=tp, method=method or "plain", batch=B, tok_s=tok_s, ms_per_token_step=step_s * 1e3,
                           bound_tok_s=bound, of_bound=tok_s / bound, tau=tau, weight_bytes_per_device=wbytes,
                           draft_tp=None if spec is None else spec["draft_tensor_parallel_size"])
                rows.append(row)
                print(f"tp={tp} {row['method']:6s} B={B:3d}: {tok_s:9.1f} tok/s decode ({step_s * 1e3:6.2f} ms per "
                      f"token per row), bound {bound:9.1f} -> {tok_s / bound:5.1%} (tau {tau:.2f}, "
                      f"{wbytes / 2**30:.2f} GiB weights per device)", flush=True)
            del llm, eng
            gc.collect()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_tp.json"), "w") as f:
            json.dump({"bandwidth_TBps": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
