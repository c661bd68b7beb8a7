"""Offline throughput, vLLM's benchmark_throughput in meaning (issue 58): N prompts of I tokens,
O new tokens each, one ``jspec.LLM.generate`` call; requests/s, output and total tok/s, each
beside the workload's hardware bound from the bandwidth and matrix-peak probes of the same run
(``workload_bound``). Plain, and each drafter with synthetic acceptance.

    # the 8B shape, random weights, 512 x (1,024 -> 256), plain then EAGLE3 at tau 3.5
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --methods none,eagle3 --tau 3.5
    # DFlash and PEagle (the Qwen3 shape) at their issue's acceptance lengths
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --methods none,dflash:6.5,peagle:4.5 --dynamic on
    # text prompts from a file (one per line), the model's tokenizer when the folder has one
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --dataset prompts.txt --num-prompts 200
    # the 8B shape's projections as FP8 (weight-only), plain and EAGLE3; [and an FP8 KV cache]
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --methods none,eagle3 --quantization fp8 [--kv-cache-dtype fp8]
    # a poor drafter against plain at each batch (B prompts at once, one engine per method),
    # with dynamic speculation (each step's drafts chosen as pays; its widths and times printed)
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --methods none,eagle3 --tau 1.3 --batches 1,8,32,64,128,256 --dynamic on
    PYTHONPATH=.:scripts python3 scripts/bench_throughput.py --quick     # tiny shapes (CPU smoke)

The bound (../shared/reference/performance.md, "Bounds"): prefill FLOPs (2 x the
non-embedding parameters a token passes, plus causal attention) over the matrix peak, plus
every decode step's bytes (the streamed weights and the KV its rows read, at most
max_num_seqs rows a step) over the bandwidth: a lower bound on the time, as neither term
waits for the other. A speculative run is held to the same bound: the work is the
workload's, however it is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import LLAMA_1B, LLAMA_8B, QWEN3_8B, TINY, drafter_config, measure_bandwidth, settle, timeit
from bench_llm_folders import write_folders, write_target_folder

# Drafters as the llm section runs them: EAGLE3 / n-gram / a draft model on the Llama shape,
# DFlash / PEagle on Qwen3's (their published drafters' targets).
LLAMA_METHODS = ("none", "eagle3", "ngram", "draft_model")
DEFAULT_K = {"eagle3": 3, "peagle": 7, "dflash": 15, "ngram": 3, "draft_model": 3}


def measure_matrix_peak(quick: bool) -> float:
    """bf16 matrix-multiply FLOP/s: the best of square GEMMs through XLA (the prefill's op)."""
    best, mm = 0.0, jax.jit(lambda x, y: x @ y)
    for n in ((256,) if quick else (4096, 8192)):
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
        best = max(best, 2 * n**3 / timeit(lambda a=a, b=b: mm(a, b), reps=10))
    return best


@dataclasses.dataclass(frozen=True)
class Bound:
    prefill_s: float
    decode_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def workload_bound(cfg, n: int, inp: int, out: int, max_seqs: int, peak_flops: float, bw: float,
                   itemsize: int = 2, layer_itemsize: int | None = None, kv_itemsize: int | None = None) -> Bound:
    """The hardware bound of ``n`` prompts of ``inp`` tokens -> ``out`` new tokens each at most
    ``max_seqs`` at a time, for a dense target ``cfg``: prefill FLOPs / ``peak_flops`` +
    decode bytes / ``bw`` (bytes/s). The first new token comes from the prefill; each of the
    other out - 1 is a decode step of the wave's rows, streaming the layers' and the
    lm_head's weights once and reading each row's KV so far. ``layer_itemsize``: bytes of a
    layer's weight (1: FP8 projections; default ``itemsize``, also the lm_head's);
    ``kv_itemsize``: of a KV value (1: an FP8 cache; default ``itemsize``)."""
    H, L = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = H * (q + 2 * kv) + q * H + 3 * H * cfg.intermediate_size  # a layer's matrices (norms: negligible)
    head = cfg.vocab_size * H
    # causal attention: position p's query meets p + 1 keys, in QK^T and in PV (2 FLOPs a MAC)
    flops_prompt = 2 * L * layer * inp + 2 * 2 * L * q * (inp * (inp + 1) // 2) + 2 * head
    kv_token = 2 * L * kv * (kv_itemsize or itemsize)  # K and V of one token, every layer
    decode_bytes = 0.0
    for start in range(0, n, max_seqs):
        rows = min(max_seqs, n - start)
        steps = out - 1
        # step j (1..out-1) writes its token's K and V at position inp + j - 1 and reads inp + j
        kv_read = rows * kv_token * (steps * inp + steps * (steps + 1) // 2)
        decode_bytes += steps * (L * layer * (layer_itemsize or itemsize) + head * itemsize) + kv_read
    return Bound(n * flops_prompt / peak_flops, decode_bytes / bw)


def prompts_of(args, cfg, rng, tokenizer, n: int):
    """``n`` token-id prompts: random ids (specials excluded), or lines of ``--dataset`` encoded
    by the folder's tokenizer, cut or repeated to --input-len tokens."""
    if args.dataset == "random":
        return [rng.integers(0, cfg.vocab_size - 8, args.input_len).tolist() for _ in range(n)]
    if tokenizer is None:
        raise SystemExit(f"--dataset {args.dataset}: the model folder has no tokenizer to encode it with")
    with open(args.dataset) as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    out = []
    for i in range(n):
        ids = tokenizer.encode(lines[i % len(lines)], add_special_tokens=False) or [0]
        out.append((ids * (-(-args.input_len // len(ids))))[: args.input_len])
    return out


def run(args, method: str, folders, cfg, bw, peak, plain: dict, tau: float) -> list[dict]:
    """One engine for ``method`` at synthetic acceptance length ``tau``, timed on each
    workload: --num-prompts prompts, or with --batches B prompts for each B (batch B: every
    request runs at once). ``plain``: plain's seconds by workload size, for the ratio."""
    import jspec

    K = args.k or DEFAULT_K.get(method, 0)
    tdir, ddir = folders
    spec = None
    if method != "none":
        spec = {"method": method, **({} if method == "ngram" else {"model": ddir}), "num_speculative_tokens": K,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": tau}
        spec["dynamic"] = args.dynamic == "on"  # dynamic speculation (jspec/engine/dynamic_spec.py)
    kw = dict(dtype="bfloat16", load_format="dummy", max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              max_model_len=args.input_len + args.output_len + 2 * (K + 1) + 16,
              max_num_batched_tokens=args.max_num_batched_tokens)
    kw.update({k: v for k in ("max_prefill_chunk", "max_num_partial_prefills", "quantization", "kv_cache_dtype")
               if (v := getattr(args, k)) is not None})
    if args.quick:  # a CPU: every shape compiled before the timed call, as an accelerator does at construction
        kw.update(num_pages=args.max_num_seqs * (-(-kw["max_model_len"] // 16) + 2) + 8, warmup=True)
    if args.pool_only:
        kw.update(warmup=False)
    llm = jspec.LLM(tdir, speculative_config=spec, **kw)
    kv_dtype = llm.engine.runner.kv.k[0].dtype
    print(f"{method}: KV pool {llm.engine.num_pages} pages x {llm.engine.config.page_size} tokens ({kv_dtype}) at "
          f"gpu_memory_utilization {llm.engine.config.gpu_memory_utilization}", flush=True)
    if args.pool_only:
        return []
    sizes = [int(b) for b in args.batches.split(",")] if args.batches else [args.num_prompts]
    rng = np.random.default_rng(0)
    prompts = prompts_of(args, cfg, rng, llm.engine.tokenizer, max(sizes))
    sp = jspec.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)  # (every shape is compiled: LLM's warmup) first-call costs
    settle()  # warmup's executables written before the clock starts
    rows = []
    waits = ReadWaits(llm.engine.runner)
    clock = PhaseClock(llm.engine.scheduler)
    trace = PolicyTrace(llm.engine.policy) if args.trace_policy and llm.engine.policy is not None else None
    for n in sizes:
        llm.engine.spec_metrics.__init__()
        before = llm.engine.stats()
        waits.reset()
        clock.reset()
        if trace:
            trace.steps = []
        t = time.perf_counter()
        outs = llm.generate(prompts[:n], sp, use_tqdm=False)
        secs = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(p) for p in prompts[:n])
        bound = workload_bound(cfg, n, args.input_len, args.output_len, args.max_num_seqs, peak, bw,
                               layer_itemsize=1 if args.quantization else None,
                               kv_itemsize=1 if args.kv_cache_dtype == "fp8" else None)
        measured = llm.engine.spec_metrics.mean_acceptance_length if spec else None
        after = llm.engine.stats()
        reads = waits.by_width()
        widths = {q: n_q - before.get("decode_steps_by_width", {}).get(q, 0)
                  for q, n_q in after.get("decode_steps_by_width", {}).items()}
        row = dict(method=method, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   K=K if spec else 0,
                   synthetic_tau=tau if spec else None, tau=measured,
                   num_prompts=n, input_len=args.input_len, output_len=args.output_len,
                   max_num_seqs=args.max_num_seqs, kv_pages=llm.engine.num_pages, seconds=secs, requests_per_s=n / secs,
                   output_tok_s=n_out / secs, total_tok_s=(n_in + n_out) / secs, bound_s=bound.seconds,
                   bound_prefill_s=bound.prefill_s, bound_decode_s=bound.decode_s, of_bound=bound.seconds / secs,
                   vs_plain=plain[n] / secs if n in plain else None, decode_steps_by_width=widths,
                   step_ms=step_times(llm.engine), read_wait_s=waits.seconds, reads=waits.calls,
                   reads_by_width={str(q): v for q, v in reads.items()},
                   prefill_phase_s=clock.prefill_s, decode_steps=clock.decode_steps,
                   **({"policy_trace": trace.steps,
                       "read_sequence": [(q, round(b, 3), round(w, 3)) for q, b, w in waits.sequence]} if trace else {}))
        label = "plain" if spec is None else f"{method} K={K} tau {measured:.2f}"
        vs = "" if row["vs_plain"] is None else f"; {row['vs_plain']:.2f}x plain"
        vs += f"; decode steps by width {widths}" if widths else ""
        vs += f"; {waits.calls} reads waited {waits.seconds:.2f} s"
        vs += "; by width, reads / ms between / ms waited (medians) " + ", ".join(
            f"{q}: {c} / {i:.2f} / {w:.2f}" for q, (c, i, w) in reads.items())
        vs += f"; prefill phase {clock.prefill_s:.2f} s" if clock.prefill_s is not None else ""
        print(f"{label}: {n} x ({args.input_len} -> {args.output_len}), {secs:.2f} s: "
              f"{row['requests_per_s']:.2f} req/s, {row['output_tok_s']:.0f} output tok/s, {row['total_tok_s']:.0f} "
              f"total tok/s; hardware bound {bound.seconds:.2f} s (prefill {bound.prefill_s:.2f} s at "
              f"{peak / 1e12:.0f} TFLOP/s + decode {bound.decode_s:.2f} s at {bw / 1e12:.2f} TB/s) -> "
              f"{row['of_bound']:.2f} of it{vs}", flush=True)
        rows.append(row)
        del outs
    waits.close()  # (its wrapper holds the runner: the next engine needs that memory)
    clock.close()
    del llm, waits, clock
    gc.collect()
    return rows


class ReadWaits:
    """Time the host spends in the runner's reads (waiting for the device, then the copy):
    what is left of a run's seconds is the host's own work. A run of many reads that
    waited little is bound by the host, not the device. By the width of the call read
    (``q``; None: a plain engine's, or a step that prefills), each read's wait and the time
    from the read before it returned to this one's return (with async scheduling, a call's
    share of the wall clock): ``by_width``; ``sequence``: every read in order, (q, ms between,
    ms waited), for what a switch of width costs the calls after it (--trace-policy)."""

    def __init__(self, runner):
        self.runner, self.read = runner, runner.read
        self.reset()
        # q's place in runner.read's signature, found once: each read then takes it by position or by name
        qi = list(inspect.signature(self.read).parameters).index("q")

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return self.read(*a, **kw)
            finally:
                now = time.perf_counter()
                self.seconds += now - t
                self.calls += 1
                q = a[qi] if len(a) > qi else kw.get("q")
                if self._last is not None:
                    self.sequence.append((q, 1e3 * (now - self._last), 1e3 * (now - t)))
                self._last = now

        runner.read = timed

    def reset(self):
        self.seconds, self.calls, self._last, self.sequence = 0.0, 0, None, []

    def by_width(self) -> dict:
        """{q: (reads, median ms between read returns, median ms waited in the read)}."""
        per = {}
        for q, between, waited in self.sequence:
            per.setdefault(q, []).append((between, waited))
        return {q: (len(v), float(np.median([i for i, _ in v])), float(np.median([w for _, w in v])))
                for q, v in sorted(per.items(), key=lambda kv: -1 if kv[0] is None else kv[0])}

    def close(self):
        del self.runner.read  # the class's method again
        self.runner = self.read = None


class PhaseClock:
    """Seconds from a run's start to its first decode step scheduled after the last step
    that prefilled (prefill and mixed steps): where every prompt is admitted at once (B <=
    max_num_seqs, no mixed steps), the prefill phase; the rest is decoding."""

    def __init__(self, scheduler):
        self.scheduler, self.schedule = scheduler, scheduler.schedule
        self.reset()

        def timed(*a, **kw):
            out = self.schedule(*a, **kw)
            if out is not None:
                now = time.perf_counter() - self.t0
                if out.kind != "decode":
                    self.prefill_s, self._prefilling = None, True
                elif self._prefilling:
                    self.prefill_s, self._prefilling = now, False
                self.decode_steps += out.kind == "decode"
            return out

        scheduler.schedule = timed

    def reset(self):
        self.t0, self.prefill_s, self._prefilling, self.decode_steps = time.perf_counter(), None, False, 0

    def close(self):
        del self.scheduler.schedule
        self.scheduler = self.schedule = None


class PolicyTrace:
    """Each decode call's choice (--trace-policy; a mixed step's rows too, ``mixed``): width, batch bucket, rows, drafts
    scheduled, the mean estimated acceptance per draft position and the times (ms) the
    policy held for each width at that bucket."""

    def __init__(self, policy):
        self.steps, choose = [], policy.choose

        def traced(rows, N, fixed=False, mixed=False):
            q, ks = choose(rows, N, fixed, mixed)
            rates = policy.rates([r[0] for r in rows]).mean(0) if rows else []
            self.steps.append(dict(q=q, N=N, rows=len(rows), drafts=int(sum(ks)), mixed=mixed,
                                   rates=[round(float(x), 3) for x in rates],
                                   ms={w: round(policy.times[(w, N)] * 1e3, 2) for w in policy.widths
                                       if (w, N) in policy.times}))
            return q, ks

        policy.choose = traced


def step_times(engine) -> dict:
    """Dynamic speculation's step times, ms by "width,batch bucket": measured, and warmup's on empty rows."""
    p = engine.policy
    if p is None:
        return {}
    return {f"{kind} {q},{N}": round(t * 1e3, 2) for kind, d in (("measured", p.times), ("warm", p.warm))
            for (q, N), t in sorted(d.items())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,eagle3", help="'none' (plain) and drafters: eagle3, peagle, "
                    "dflash, ngram, draft_model (each beside the plain run of its target); METHOD:TAU sets "
                    "that drafter's synthetic acceptance length (default --tau)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-prefill-chunk", type=int, default=None, help="tokens of one prompt per step")
    ap.add_argument("--max-num-partial-prefills", type=int, default=None, help="> 0: decode rows and this many "
                    "prefill chunks share a step")
    ap.add_argument("--batches", default=None, help="comma-separated workload sizes in place of --num-prompts, "
                    "each B prompts at once on one engine (batch B when B <= --max-num-seqs): speedup by batch")
    ap.add_argument("--dataset", default="random", help="'random' token ids, or a text file of prompts (a line each)")
    ap.add_argument("--dynamic", choices=("on", "off"), default="off",
                    help="speculative_config 'dynamic': the width of each decode step chosen as pays")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the target's projections as FP8, quantized per output channel as they load (vLLM's "
                         "online fp8; the drafters stay unquantized); the bound counts a layer's weights at a byte")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                    help="the target's KV cache: the model's dtype, or FP8 (e4m3, scales 1.0: twice the pages); "
                         "the bound counts a KV value at a byte")
    ap.add_argument("--tau", type=float, default=3.5, help="synthetic acceptance length of the drafters")
    ap.add_argument("-k", "--k", type=int, default=0, help="num_speculative_tokens (default: the method's)")
    ap.add_argument("--trace-policy", action="store_true", help="dynamic speculation's choice at each decode "
                    "call, in the json rows (policy_trace)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and workload (a CPU smoke run)")
    ap.add_argument("--pool-only", action="store_true", help="build each engine (no warmup), print its KV pool, "
                    "run nothing")
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/bench_throughput.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.input_len, args.output_len, args.num_prompts, args.max_num_seqs = 24, 8, 6, 4
    bwd = measure_bandwidth(args.quick)
    bw, peak = bwd["best_TBps"] * 1e12, measure_matrix_peak(args.quick)
    print(f"{jax.devices()[0].device_kind}: bandwidth {bwd}, bf16 matrix peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    root = tempfile.mkdtemp(prefix="jspec_bench_throughput_")
    taus = dict((m.split(":")[0], float(m.split(":")[1]) if ":" in m else args.tau) for m in args.methods.split(","))
    methods = list(taus)
    rows, plain = [], {}
    drafters = [m for m in methods if m != "none"]
    for family in ("llama", "qwen3"):
        mine = [m for m in drafters if (m in LLAMA_METHODS) == (family == "llama")]
        if not mine and (drafters or family != "llama"):  # plain alone: the Llama shape's
            continue
        cfg = dataclasses.replace(TINY, family=family, qk_norm=family == "qwen3") if args.quick else \
            (LLAMA_8B if family == "llama" else QWEN3_8B)
        for method in ["none"] + [m for m in mine if m != "none"]:
            dc = drafter_config("eagle3" if method in ("none", "ngram", "draft_model") else method, cfg, args.quick)
            folders = write_folders(os.path.join(root, method), cfg, dc, DEFAULT_K.get(method, 3))
            if method == "draft_model":
                small = dataclasses.replace(TINY, num_layers=2) if args.quick else LLAMA_1B
                folders = (folders[0], write_target_folder(os.path.join(root, "draft-model"), small))
            got = run(args, method, folders, cfg, bw, peak, plain.get(family, {}), taus.get(method, args.tau))
            if method == "none":
                plain[family] = {r["num_prompts"]: r["seconds"] for r in got}
            rows += [dict(r, family=family) for r in got]
    out = args.json or (os.path.join(os.environ["OUT"], "bench_throughput.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, bandwidth=bwd,
                           matrix_peak_tflops=peak / 1e12, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
