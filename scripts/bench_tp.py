"""Tensor-parallel decode throughput (issue 29): jspec.LLM at each tensor_parallel_size of
--tps, plain and with a drafter, at batch sizes --batches.

Random bf16 weights (load_format="dummy": folders holding only config.json, written by
scripts/bench_llm_folders.py), prompts of --ctx random tokens, --new greedy tokens, timed
through LLM.generate with the prefill subtracted (a 1-token run of the same prompts;
bench_common.py's llm_run). The drafter runs with synthetic acceptance (random weights accept
nothing): --length tokens per verification on average. Each row is printed next to the
bandwidth bound of one device: (its share of the non-embedding weights + the KV it reads
per step) / one device's HBM bandwidth measured in the same run (bench_common.py's
measure_bandwidth); a speculative row's bound is the plain bound times the acceptance length.

    python scripts/bench_tp.py --model llama-8b --tps 1,2,4,8            # one host, up to 8 GPUs
    python scripts/bench_tp.py --model llama-70b --tps 4,8 --methods eagle3
    python scripts/bench_tp.py --quick --tps 1,2 --cpu-devices 2         # CPU smoke test

--allreduce: first, the latency of one all-reduce as the engine issues it (a bf16 [B, hidden]
partial sum psum'd over the "tp" axis inside a jitted program, 128 of them chained so that
each waits for the last; wall clock per all-reduce, and on a GPU the profiler's mean kernel
time). --profile: the plain engine's decode step at batch 1 by the profiler's kernel records
(a run of --new tokens minus a run of one), collectives apart from the rest, per device.
--greedy N: the plain engine's greedy tokens (4 seeded prompts, N new tokens) at each tp
compared with tp 1's, with the first position where they part.
--procs: each tp > 1 as tp processes of one device each (JAX_LOCAL_DEVICE_IDS), joined as
the nodes of jspec/parallel/multihost.py on this host (vLLM's multiprocessing executor: a
host thread per device); node 0 times, the others follow. tp 1 runs in a process of its own.
Results go to $OUT/bench_tp.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
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
    ap.add_argument("--allreduce", action="store_true", help="all-reduce latency first (module docstring)")
    ap.add_argument("--allreduce-only", action="store_true", help="the all-reduce latency alone, no engine")
    ap.add_argument("--profile", action="store_true", help="the batch-1 plain decode step by kernel records")
    ap.add_argument("--greedy", type=int, default=0, help="new tokens of the greedy comparison across tp (0: off)")
    ap.add_argument("--spec-batches", default="", help="batch sizes of the speculative rows (default: --batches)")
    ap.add_argument("--dtype", default="bfloat16", help="the weights' dtype (the greedy comparison: float32 too)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the target's projections as FP8, quantized per output channel as they load (the drafter "
                         "stays unquantized); the bounds count the bytes each device holds")
    ap.add_argument("--label", default="", help="a tag for this run's rows (e.g. the XLA flags it ran with)")
    ap.add_argument("--procs", action="store_true", help="one process per device (module docstring)")
    ap.add_argument("--master-port", type=int, default=29533, help="--procs: node 0's coordinator port")
    ap.add_argument("--node-rank", type=int, default=None, help=argparse.SUPPRESS)  # --procs' children
    return ap.parse_args(argv)


# XLA 0.11.2 names the all-reduce kernels of a shard_map psum "psum_<n>_0_fusion_1", its
# partitioner's "all_reduce_<n>_0_fusion_1"; NCCL's are "ncclDevKernel_*".
COLLECTIVE = re.compile(r"nccl|psum|all_?reduce|allreduce|all_?gather|reduce_?scatter|collective|one_?shot", re.I)


def allreduce_latency(tp: int, rows: int, hidden: int, chain: int = 128) -> dict:
    """One all-reduce of a bf16 [rows, hidden] partial sum over the first ``tp`` devices, as
    the engine's SPMD program issues it (an all-reduce over the "tp" axis inside a jitted
    program): ``chain`` of them back to back, each on the last one's result."""
    import jax
    import jax.numpy as jnp
    from bench_common import timeit
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jspec.parallel.mesh import make_mesh

    mesh = make_mesh(tp)

    def body(x):  # unrolled: a loop would add its host-side trip test to every all-reduce
        for _ in range(chain):
            x = jax.lax.psum(x, "tp") * jnp.asarray(1.0 / tp, x.dtype)
        return x

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jax.device_put(jnp.ones((tp * rows, hidden), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    wall_us = timeit(lambda: f(x), reps=10) / chain * 1e6
    out = dict(tp=tp, rows=rows, hidden=hidden, chain=chain, wall_us=wall_us)
    if jax.default_backend() == "gpu":
        from gpu_trace import device_times

        t = device_times(f, [(x,)], reps=5)
        ndev = min(tp, jax.local_device_count())  # the devices this process traced (its own under --procs)
        coll = {n: us for n, us in t["kernels_us"].items() if COLLECTIVE.search(n)}
        # kernel time per all-reduce on one device (every device runs each all-reduce once)
        out["kernel_us"] = sum(coll.values()) / chain / ndev
        out["kernels"] = sorted(coll)[:4]
        out["busy_us"] = t["busy_us"] / chain / ndev
        # On 4 x H100 (2026-11-26) no kernel name matched COLLECTIVE here, while the engine's
        # step showed ncclDevKernel_AllGather: the top names say what ran instead.
        out["top_kernels_us"] = [(n[:80], round(us / chain, 2)) for n, us in list(t["kernels_us"].items())[:4]]
    return out


def streamed_bytes(params) -> int:
    """Bytes of ``params`` on the first device that a decode step streams: every leaf's shard
    there but the embeddings' (their rows are gathered, not streamed)."""
    import jax

    from jspec import parallel

    dev0 = jax.devices()[0]
    return sum(parallel.device_param_bytes(leaf).get(dev0, 0)
               for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if "embed_tokens" not in jax.tree_util.keystr(path))


def _gap(logprobs: dict) -> float:
    """The top-2 logprob gap of one position's {token: Logprob} (the greedy choice's margin)."""
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def decode_profile(llm, ctx: int, new: int, rng) -> dict:
    """The plain decode step at batch 1 by the profiler's kernel records, per device: the
    GPU time of a greedy run of ``new`` tokens minus that of a run of 1 (its prefill), over
    the ``new - 1`` decode steps, split into collectives and the rest."""
    import collections
    import glob
    import tempfile

    import jax
    from gpu_trace import _device_events  # noqa: PLC2701 (the same trace reader)

    import jspec

    V = llm.engine.model_cfg.vocab_size
    prompt = [[int(t) for t in rng.integers(0, V, ctx)]]
    per, by_name = {}, {}
    for n in (new, 1):
        sp = jspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompt, sp, use_tqdm=False)  # compiled already (llm_run); warm
        d = tempfile.mkdtemp(prefix="jspec_tp_trace_")
        with jax.profiler.trace(d):
            llm.generate(prompt, sp, use_tqdm=False)
        events = _device_events(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        c, names = collections.Counter(), collections.Counter()
        for name, ns, _ in events:
            coll = bool(COLLECTIVE.search(name))
            c["collective" if coll else "other"] += ns
            c["n_collective"] += coll
            c["n_kernels"] += 1
            names[name] += ns
        starts = [t0 for _, _, t0 in events]
        c["span"] = max(t0 + ns for _, ns, t0 in events) - min(starts)
        per[n], by_name[n] = c, names
    # each kernel's time in the decode steps: the 1-token run's (its prefill) taken off, as for the totals
    names = by_name[new] - by_name[1]
    top = [(k[:90], round(v / 1e3 / (new - 1), 1)) for k, v in names.most_common(8)]
    # the devices this process traced: all tp of them, or its own under --procs
    ndev, steps = min(llm.engine.runner.plan.tp, jax.local_device_count()), new - 1
    f = lambda k: (per[new][k] - per[1][k]) / steps / ndev  # noqa: E731
    return dict(collective_us=f("collective") / 1e3, other_us=f("other") / 1e3,
                collectives_per_step=f("n_collective"), kernels_per_step=f("n_kernels"),
                span_us=(per[new]["span"] - per[1]["span"]) / steps / 1e3, top_kernels_us=top)


def _wait_all(procs) -> list:
    """The exit codes of ``procs``; when one fails, the others are killed, not left waiting
    in a collective for it."""
    import time

    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.5)
    return [p.returncode for p in procs]


def spawn(argv, args) -> dict:
    """--procs: each tp of --tps as tp child processes of this script (one device each, ranks
    0..tp-1); their node 0's rows merged, each tp > 1 row set beside tp 1's."""
    import subprocess

    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--procs"]
    result: dict = {"label": args.label or "procs", "procs": True, "rows": []}
    for tp in [int(t) for t in args.tps.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            procs = []
            for rank in range(tp):
                env = dict(os.environ, OUT=out, JAX_LOCAL_DEVICE_IDS=str(rank))
                if args.cpu_devices:  # one virtual CPU device per process
                    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--tps", str(tp), "--node-rank", str(rank),
                       "--label", f"procs_tp{tp}"]
                if args.cpu_devices:
                    cmd += ["--cpu-devices", "0"]
                procs.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
            rcs = _wait_all(procs)
            if any(rcs):
                raise SystemExit(f"--procs tp={tp}: the processes exited with {rcs}")
            with open(os.path.join(out, f"bench_tp_procs_tp{tp}.json")) as f:
                part = json.load(f)
        for row in part["rows"]:
            base = next((r for r in result["rows"] if r["tp"] == 1 and r["method"] == row["method"]
                         and r["batch"] == row["batch"]), None)
            if base is not None and tp > 1:
                row["tp1_speedup"] = row["tok_s"] / base["tok_s"]
                print(f"--procs tp={tp} {row['method']} B={row['batch']}: {row['tok_s']:.1f} tok/s, "
                      f"{row['tp1_speedup']:.2f}x tp=1", flush=True)
            result["rows"].append(row)
        for k in ("bandwidth_TBps", "profile", "allreduce"):
            if k in part:
                result.setdefault(k, []).append(part[k])
    return _write(result)


def main(argv=None):
    args = parse(argv)
    if args.procs and args.node_rank is None:
        return spawn(argv, args)
    nnodes = int(args.tps) if args.node_rank is not None else 1  # a --procs child: one tp, one device each
    node = dict(nnodes=nnodes, node_rank=args.node_rank or 0, master_port=args.master_port) if nnodes > 1 else {}
    lead = not args.node_rank
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # bench_common.py's helpers; this checkout's jspec
    import jax
    import numpy as np

    from jspec.parallel import multihost

    multihost.initialize(nnodes, args.node_rank or 0, "127.0.0.1", args.master_port)  # before jax's backend starts
    from bench_common import LLAMA_8B, QWEN3_8B, TINY, drafter_config, llm_run, measure_bandwidth, physical_ideal
    from bench_llm_folders import write_folders

    import jspec
    from jspec import parallel

    llama_70b = dataclasses.replace(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                    num_heads=64, num_kv_heads=8)
    cfg = TINY if args.quick else {"llama-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B, "llama-70b": llama_70b}[args.model]
    ctx, new = (32, 16) if args.quick else (args.ctx, args.new)
    batches = [int(b) for b in args.batches.split(",") if b]
    tps = [int(t) for t in args.tps.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    spec_batches = [int(b) for b in args.spec_batches.split(",") if b]
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    result: dict = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    if nnodes > 1:  # a --procs child: tp 1's greedy tokens are in another process
        args.greedy = 0
    if args.allreduce or args.allreduce_only:
        result["allreduce"] = []
        for tp in tps:
            for B in (1, 32) if tp > 1 and (nnodes == 1 or nnodes == tp) else ():
                r = allreduce_latency(tp, B, cfg.hidden_size)
                result["allreduce"].append(r)
                print(f"all-reduce tp={tp}{' (a process per device)' if nnodes > 1 else ''} bf16 [{B}, {cfg.hidden_size}]: {r['wall_us']:.1f} us per all-reduce "
                      f"(wall clock, {r['chain']} chained)"
                      + (f", {r['kernel_us']:.1f} us collective kernel time {r['kernels']}; GPU busy "
                         f"{r['busy_us']:.1f} us per device; top kernels {r['top_kernels_us']}"
                         if "kernel_us" in r else ""),
                      flush=True)
    if args.allreduce_only:
        return _write(result) if lead else result
    bw = measure_bandwidth(args.quick)["best_TBps"] * 1e12 if lead else 0.0  # one device
    result["bandwidth_TBps"] = bw / 1e12
    print(f"{bw / 1e12:.2f} TB/s per device; {args.model if not args.quick else 'tiny'}, ctx {ctx}, "
          f"{new} new tokens", flush=True)
    root, rng, rows = tempfile.mkdtemp(prefix="jspec_bench_tp_"), np.random.default_rng(0), result["rows"]
    num_pages = max(batches + [4]) * (-(-(ctx + new + 128) // 16) + 2) + 8
    common = dict(dtype=args.dtype, load_format="dummy", quantization=args.quantization,
                  max_num_seqs=max(batches + [4]), enable_prefix_caching=False, max_model_len=ctx + new + 96,
                  num_pages=num_pages)
    greedy_prompts = [[int(t) for t in np.random.default_rng(100 + i).integers(0, cfg.vocab_size, 64)]
                      for i in range(4)]
    greedy_ref = None
    for tp in tps:
        plain = {}  # batch -> (tok/s, step s)
        for method in [None] + methods:
            dc = drafter_config(method or "eagle3", cfg, args.quick)
            K = dc.block_size - 1 if method == "dflash" else args.k
            tdir, ddir = write_folders(os.path.join(root, method or "plain"), cfg, dc, K)
            spec = None if method is None else {
                "method": method, "model": ddir, "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_length": args.length,
                "draft_tensor_parallel_size": tp if args.draft_tp == "same" else 1}
            try:
                llm = jspec.LLM(tdir, speculative_config=spec, tensor_parallel_size=tp, **common, **node)
            except ValueError as e:  # a size that does not split this shape: say so, go on
                print(f"tp={tp} {method or 'plain'}: {e}", flush=True)
                continue
            eng = llm.engine
            if not lead:  # a --procs child of rank >= 1: node 0's calls, until it closes this engine
                llm.follow()
                del llm, eng
                gc.collect()
                continue
            wbytes = streamed_bytes(eng.runner.params)
            dbytes = 0
            if spec is not None:  # the drafter's bytes on one device (+ the target's lm_head if it borrows it)
                dbytes = streamed_bytes(eng.runner.dparams)
                if dc.uses_target_lm_head:
                    dbytes += cfg.vocab_size * cfg.hidden_size * 2 // tp
            kv_row = 2 * cfg.num_layers * parallel.local_kv_heads(cfg.num_kv_heads, tp) * cfg.head_dim * 2
            if spec is None and args.greedy:
                sp = jspec.SamplingParams(temperature=0.0, max_tokens=args.greedy, ignore_eos=True, logprobs=2)
                outs = [o.outputs[0] for o in llm.generate(greedy_prompts, sp, use_tqdm=False)]
                toks = [list(o.token_ids) for o in outs]
                if greedy_ref is None:  # the first tp's tokens, and its top-2 logprob gap at each position
                    greedy_ref, gaps = toks, [[_gap(lp) for lp in o.logprobs] for o in outs]
                parted = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None)
                          for t, r in zip(toks, greedy_ref)]
                margin = [None if i is None else gaps[j][i] for j, i in enumerate(parted)]
                smallest = min(min(g) for g in gaps)
                result.setdefault("greedy", []).append(dict(tp=tp, first_difference=parted, top2_gap_there=margin,
                                                            smallest_gap=smallest))
                print(f"tp={tp} greedy, 4 prompts x {args.greedy} tokens ({args.dtype}): "
                      + ("same as the first tp" if all(p is None for p in parted)
                         else f"first difference at {parted}; the first tp's top-2 logprob gap there {margin}")
                      + f" (smallest gap of the first tp's {4 * args.greedy} positions: "
                        f"{smallest:.2e})", flush=True)
            for B in batches if spec is None else (spec_batches or batches):
                if spec is not None:
                    eng.spec_metrics.__init__()
                tot, pf = llm_run(llm, B, ctx, new, rng)
                step_s = (tot - pf) / (new - 1)
                tok_s = B * (new - 1) / (tot - pf)
                bound = B / ((wbytes + B * (ctx + new // 2) * kv_row) / bw)
                tau = eng.spec_metrics.mean_acceptance_length if spec is not None else 1.0
                row = dict(tp=tp, method=method or "plain", batch=B, tok_s=tok_s, ms_per_token_step=step_s * 1e3,
                           bound_tok_s=bound, of_bound=tok_s / bound, tau=tau, weight_bytes_per_device=wbytes,
                           draft_tp=None if spec is None else spec["draft_tensor_parallel_size"], label=args.label)
                extra = ""
                if spec is None:
                    plain[B] = (tok_s, step_s)
                    row["tp1_speedup"] = None
                    base = next((r for r in rows if r["tp"] == 1 and r["method"] == "plain" and r["batch"] == B), None)
                    if base is not None and tp > 1:
                        row["tp1_speedup"] = tok_s / base["tok_s"]
                        extra = f"; {row['tp1_speedup']:.2f}x tp=1"
                elif B in plain:
                    # The physical ideal with T(1) the plain engine's step at this tp and batch,
                    # measured above, and the drafter's bytes on one device.
                    ideal = physical_ideal(tau, plain[B][1], dbytes, bw)
                    row.update(speedup=tok_s / plain[B][0], physical_ideal=ideal, drafter_bytes_per_device=dbytes)
                    extra = (f"; speedup {row['speedup']:.2f}x over plain tp={tp}, physical ideal {ideal:.2f}x "
                             f"-> {row['speedup'] / ideal:.1%}")
                rows.append(row)
                print(f"tp={tp} {row['method']:6s} B={B:3d}: {tok_s:9.1f} tok/s decode ({step_s * 1e3:6.2f} ms per "
                      f"token per row), bound {bound:9.1f} -> {tok_s / bound:5.1%} (tau {tau:.2f}, "
                      f"{wbytes / 2**30:.2f} GiB weights per device){extra}", flush=True)
            if spec is None and args.profile and jax.default_backend() == "gpu":
                p = decode_profile(llm, ctx, new, rng)
                p.update(tp=tp, label=args.label, step_ms=plain[1][1] * 1e3 if 1 in plain else None)
                result.setdefault("profile", []).append(p)
                print(f"tp={tp} plain B=1 decode step by the profiler, per device: {p['collective_us']:.1f} us in "
                      f"{p['collectives_per_step']:.0f} collectives, {p['other_us']:.1f} us in other kernels "
                      f"({p['kernels_per_step']:.0f} kernels; wall-clock step "
                      + ("untimed" if p["step_ms"] is None else f"{p['step_ms']:.3f} ms")
                      + f", trace span {p['span_us']:.1f} us); top: {p['top_kernels_us']}", flush=True)
            llm.close()  # over several processes: the others stop following
            del llm, eng
            gc.collect()
    if nnodes > 1:  # every process leaves together: a follower outliving node 0's coordinator logs its loss
        jax.distributed.shutdown()
    return _write(result) if lead else result


def _write(result) -> dict:
    out = os.environ.get("OUT")
    if out:
        name = "bench_tp" + (f"_{result['label']}" if result["label"] else "") + ".json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
