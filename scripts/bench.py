"""Decode benchmarks on the GPU: plain autoregressive and speculative (synthetic acceptance).

Random bf16 weights made on the device (no checkpoint), sequences injected with their KV
already in the cache (random, never zeros), then timed through the real engine loop
(``LLMEngine.step``: scheduler, runner, host bookkeeping included). Every figure is printed
next to the bound it is compared with, measured in the same run:
  - decode roofline: (non-embedding weight bytes + KV bytes read) / HBM bandwidth, the
    bandwidth being the best of a bf16 read-only reduction and an f32 read+write copy;
  - speculative: measured speedup over the same engine without speculation, against the
    physical ideal tau * T(1) / (T(1) + drafter weight bytes / bandwidth); T(K+1) / T(1)
    and the drafter's time against its bytes / bandwidth.

    python scripts/bench.py --section plain              # issue 3 / 7: batch 1..64, ctx 512 / 4096
    python scripts/bench.py --section eagle3             # issue 5
    python scripts/bench.py --section parallel           # issue 6: DFlash + PEagle on a Qwen3-8B shape
    python scripts/bench.py --section structured         # issue 27: tok/s with and without a JSON schema
    python scripts/bench.py --section warmup             # issue 28: warmup time, serial / threaded compiles
    python scripts/bench.py --section moe --spec-batches 1,8   # a Qwen3-30B-A3B-shaped MoE target
    python scripts/bench.py --quick ...                  # tiny shapes: a CPU smoke test of the script
Results go to $OUT/bench_<section>.json when OUT is set.
"""

from __future__ import annotations

# XLA flags are left at their defaults: on jax 0.11.2 / H200 (2026-11-21, this script's
# diag section) the default GEMV path streamed weights at 3.10 TB/s, and
# --xla_gpu_enable_triton_gemm=false at 0.76 TB/s -- the reverse of an earlier note. Without
# command buffers (--xla_gpu_enable_command_buffer=), XLA's PDL (on by default in 0.11.2)
# makes batch-1 decode as fast as the default CUDA graphs, not faster (2026-11-22).
import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.target import set_path, target_param_spec
from jspec.config import ModelConfig, RopeConfig
from jspec.engine.llm_engine import EngineConfig, LLMEngine
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.sequence import Sequence, Status
from jspec.sampling_params import SamplingParams

LLAMA_8B = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, qk_norm=False, max_position_embeddings=131072,
)
QWEN3_8B = dataclasses.replace(
    LLAMA_8B, family="qwen3", vocab_size=151936, intermediate_size=12288, num_layers=36, qk_norm=True,
    rope=RopeConfig(1000000.0), rms_norm_eps=1e-6,
)
# Llama-3.2-1B's shape: the draft model of the "draft_model" rows (tied embeddings)
LLAMA_1B = dataclasses.replace(
    LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
    tie_word_embeddings=True, rope=RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192),
)
# Qwen3-30B-A3B's shape: 48 layers of 128 experts (768 wide), 8 a token
QWEN3_30B_A3B = dataclasses.replace(
    QWEN3_8B, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
    max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, moe_layers=tuple(range(48)),
)
TINY = dataclasses.replace(
    LLAMA_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=32,
)


def random_tree(specs, dtype, seed):
    """Params for ``specs`` drawn on the device: norms ~1, matrices ~N(0, 0.02)."""
    key = jax.random.PRNGKey(seed)
    tree = {}
    for i, s in enumerate(specs):
        if getattr(s, "integer", False):
            set_path(tree, s.path, jnp.zeros(s.shape, jnp.int32))
            continue
        k = jax.random.fold_in(key, i)
        scale = 0.02 if len(s.shape) > 1 else 0.1
        base = 1.0 if len(s.shape) == 1 and "norm" in "/".join(s.path) else 0.0
        set_path(tree, s.path, (base + scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype))
    return tree


def weight_bytes(tree, skip=("embed_tokens",)) -> int:
    total = 0
    for kp, v in jax.tree_util.tree_leaves_with_path(tree):
        if not any(str(getattr(k, "key", "")) in skip for k in kp):
            total += v.size * v.dtype.itemsize
    return total


def timeit(fn, reps=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _probe_time(fn, arg_sets) -> float:
    """Seconds per call: the profiler's GPU time on a GPU (no dispatch or sync in it: a
    0.24 ms GEMV timed by wall clock read ~40% slow), else the wall-clock median."""
    if jax.default_backend() == "gpu":
        from gpu_trace import device_times
        return device_times(fn, arg_sets, reps=5)["busy_us"] / 1e6
    return min(timeit(lambda a=a: fn(*a)) for a in arg_sets)


def measure_bandwidth(quick: bool) -> dict:
    """HBM bandwidths (the reference method's three): an f32 read+write copy, a bf16
    read-only column reduction, and weight streaming (a bf16 vector times the model's
    largest weights through XLA's GEMV, the decode step's own op), each over two rotating
    inputs. The roofline uses the best. A second of copies first: a GPU fresh from idle
    runs its first ones at low clocks."""
    n = (1 << 20) if quick else (1 << 30)  # 4 GiB of f32
    xs = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.float32) for i in range(2)]
    copy = jax.jit(lambda x: x * 1.0001)
    t_end = time.perf_counter() + (0.0 if quick else 1.0)
    while time.perf_counter() < t_end:
        jax.block_until_ready(copy(xs[0]))
    out = {"f32_copy_TBps": 2 * n * 4 / _probe_time(copy, [(x,) for x in xs]) / 1e12}
    del xs
    rows, cols = ((1 << 12), 256) if quick else ((1 << 16), 65536)  # 8 GiB of bf16
    ys = [jax.random.normal(jax.random.PRNGKey(9 + i), (rows, cols), jnp.bfloat16) for i in range(2)]
    red = jax.jit(lambda y: jnp.sum(y, axis=0, dtype=jnp.float32))
    out["bf16_colsum_TBps"] = rows * cols * 2 / _probe_time(red, [(y,) for y in ys]) / 1e12
    del ys
    # Weight streaming: Llama-3.1-8B's gate_up and lm_head shapes, x [1, 4096] times
    # W [F, 4096] (the engine's layout); the faster of the two.
    k = 128 if quick else 4096
    gemv = jax.jit(lambda v, w: jnp.einsum("md,fd->mf", v, w))
    v = jax.random.normal(jax.random.PRNGKey(30), (1, k), jnp.bfloat16)
    best = 0.0
    for f in ((512, 1024) if quick else (28672, 128256)):
        ws = [jax.random.normal(jax.random.PRNGKey(20 + i), (f, k), jnp.bfloat16) for i in range(2)]
        best = max(best, k * f * 2 / _probe_time(gemv, [(v, w) for w in ws]) / 1e12)
        del ws
    out["bf16_gemv_TBps"] = best
    out["best_TBps"] = max(out.values())
    return out


LINEAR_IMPL = "auto"  # --linear-impl: fused small-batch projections ("auto": on GPU) or "reference" (XLA)
PROFILE_DRAFT = False  # --kernels: also the drafter's proposal alone, by kernel
LLM_REPS = 1  # --llm-reps: timed runs per figure of the llm / structured sections (their median)
ATTN_IMPL = "auto"  # --attn-impl: the paged attention kernel ("auto": on GPU / TPU) or "reference" (XLA)


def make_engine(cfg, params, *, max_num_seqs, ctx, dtype, spec=None, drafter=None, page_size=16, extra=64,
                sched_steps=1, async_scheduling=True):
    pages_per_seq = -(-(ctx + extra) // page_size) + 2
    ec = EngineConfig(
        model=f"random-{cfg.family}", dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=ctx + extra,
        page_size=page_size, num_pages=max_num_seqs * pages_per_seq + 4, enable_prefix_caching=False,
        speculative_config=spec, num_scheduler_steps=sched_steps, linear_impl=LINEAR_IMPL, attn_impl=ATTN_IMPL,
        async_scheduling=async_scheduling,
    )
    eng = LLMEngine(ec, preloaded=(cfg, params), preloaded_drafter=drafter)
    # Random KV everywhere: attention must not run on zeros.
    kv = eng.runner.kv
    keys = jax.random.split(jax.random.PRNGKey(7), 2 * len(kv.k))
    rnd = lambda a, k: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)  # noqa: E731
    eng.runner.kv = type(kv)(k=tuple(rnd(a, k) for a, k in zip(kv.k, keys[::2])),
                              v=tuple(rnd(a, k) for a, k in zip(kv.v, keys[1::2])))
    return eng


def inject(eng, B, ctx, rng, max_tokens):
    """B running sequences whose first ctx - 1 tokens are already in the KV cache."""
    seqs = []
    for i in range(B):
        prompt = [int(t) for t in rng.integers(0, eng.model_cfg.vocab_size, ctx)]
        s = Sequence(f"bench-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                     seed=i, arrival=eng._arrivals)
        eng._arrivals += 1
        assert eng.blocks.ensure_slots(s, ctx + eng.lookahead + 1)
        s.num_computed = ctx - 1
        s.status = Status.RUNNING
        eng.scheduler.running.append(s)
        eng._seqs[s.request_id] = s
        seqs.append(s)
    return seqs


def clear(eng):
    for s in list(eng.scheduler.running):
        eng.abort_request(s.request_id)


def compile_decode(eng, B, ctx, steps):
    """Compile the decode shapes (page-table widths) a batch grows through from ctx over
    ``steps`` engine steps, so that no bucket crossing recompiles inside the timed loop."""
    from jspec.engine.buckets import pick

    r, c = eng.runner, eng.config
    pages = lambda n: pick(r.buckets.pages, -(-n // c.page_size))  # noqa: E731
    per_step = eng.K + 1 if eng.spec is not None else c.num_scheduler_steps
    # Async scheduling reserves pages two calls ahead; speculation a lookahead past the step.
    hi = min(ctx + (steps + 2) * per_step + eng.lookahead, eng.max_model_len + eng.lookahead)
    lo, hi = pages(ctx + 1), pages(hi)
    shapes = [s for s in r.warmup_shapes(c.num_scheduler_steps, eng._async)
              if s.decode and s.batch == pick(r.buckets.batch, B) and lo <= s.pages <= hi]
    r.warmup(shapes=shapes)


def engine_decode(eng, B, ctx, rng, steps):
    """Median step time and tok/s of LLMEngine.step over ``steps`` steps (after warm-up), and
    a CRC of the generated tokens (same weights and prompts: runs under other XLA flags or
    kernels must reproduce it, a check that no launch setting races)."""
    seqs = inject(eng, B, ctx, rng, max_tokens=eng.max_model_len)
    compile_decode(eng, B, ctx, steps + 3)
    for _ in range(3):  # warm
        eng.step()
    n0 = eng.num_generation_tokens
    ts = []
    t_all = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    wall = time.perf_counter() - t_all
    toks = eng.num_generation_tokens - n0
    med = statistics.median(ts)
    if max(ts) > 3 * med:  # tok/s is over the wall time: one stalled step skews it (a PEagle base read 127 for 169)
        print(f"  (a step took {max(ts) * 1e3:.1f} ms against a median of {med * 1e3:.2f}: this run's tok/s "
              f"{toks / wall:.1f} counts it; {steps} steps at the median would give {toks / (steps * med):.1f})",
              flush=True)
    digest = zlib.crc32(repr([s.output_token_ids for s in seqs]).encode())
    clear(eng)
    return med, toks / wall, digest


def verify_schedule(seqs, q):
    """A decode step verifying q tokens of each of ``seqs``: its last token and q - 1 drafts
    (token 1) set on the sequence (clear them with ``s.draft_token_ids = []`` after)."""
    for s in seqs:
        s.draft_token_ids = [1] * (q - 1)
    return SchedulerOutput("decode", [ScheduledSeq(s, q, True) for s in seqs], [])


def target_forward_time(eng, B, ctx, rng, q, gpu_time=False):
    """Time of the jitted target step at Q = q tokens per row (verification width): the
    wall-clock median, or with gpu_time the profiler's GPU busy time (scripts/gpu_trace.py)."""
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    inp, _ = eng.runner.build_input(verify_schedule(seqs, q), q)
    if gpu_time:
        from gpu_trace import device_times
        t = device_times(lambda: eng.runner.run(inp), [()], reps=10)["busy_us"] / 1e6
    else:
        t = timeit(lambda: eng.runner.run(inp), reps=15)
    for s in seqs:
        s.draft_token_ids = []
    clear(eng)
    return t


def plain_section(args, bw):
    cfg = TINY if args.quick else LLAMA_8B
    dtype = "bfloat16"
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    wbytes = weight_bytes(params)
    rng = np.random.default_rng(0)
    rows = []
    kv_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bytes per token, bf16
    # (steps per call, async scheduling, batch-1 / first-context only): the full table runs
    # with args.sched_steps and async on; batch 1 also without async and with 1 step per call.
    runs = [(1, False, True), (1, True, True)] if args.sched_steps > 1 else []
    runs += [(args.sched_steps, False, True)] if not args.no_sync_rows else []
    runs.append((args.sched_steps, True, False))
    ctxs = [int(c) for c in args.contexts.split(",")] if not args.quick else (64, 256)
    for steps_per_call, asyn, only_b1 in runs:
        for ctx in ctxs:
            if only_b1 and ctx != ctxs[0]:
                continue
            eng = make_engine(cfg, params, max_num_seqs=64 if not args.quick else 8, ctx=ctx, dtype=dtype,
                              sched_steps=steps_per_call, extra=64 + steps_per_call * (args.steps + 8),
                              async_scheduling=asyn)
            for B in [int(b) for b in args.batches.split(",")] if not args.quick else (1, 8):
                if only_b1 and B != 1:
                    continue
                c0 = eng.num_chained_calls
                step, tps, digest = engine_decode(eng, B, ctx, rng, args.steps)
                step = B / tps  # per generated token of each row: multi-step calls emit several
                bound = (wbytes + B * ctx * kv_tok) / (bw["best_TBps"] * 1e12)
                rows.append(dict(batch=B, ctx=ctx, num_scheduler_steps=steps_per_call, async_scheduling=asyn,
                                 roofline_bytes=wbytes + B * ctx * kv_tok,
                                 chained_calls=eng.num_chained_calls - c0, step_ms=step * 1e3, tok_s=tps,
                                 roofline_ms=bound * 1e3, roofline_frac=bound / step, tokens_crc=digest,
                                 attn_impl=eng.runner.plan.attn,
                                 linear_impl=eng.runner.plan.linear))
                print(f"plain B={B:3d} ctx={ctx:5d} sched_steps={steps_per_call} async={int(asyn)}: "
                      f"{step*1e3:7.2f} ms/token-step {tps:9.1f} tok/s roofline {bound*1e3:6.2f} ms -> "
                      f"{bound/step:5.1%} (chained calls {eng.num_chained_calls - c0}, tokens crc {digest:08x})", flush=True)
            del eng
    return dict(weight_bytes=wbytes, rows=rows)


def diag_section(args, bw):
    """Where a batch-1 step goes: engine loop vs the jitted step alone vs back-to-back steps."""
    cfg = TINY if args.quick else LLAMA_8B
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    wbytes = weight_bytes(params)
    rng = np.random.default_rng(0)
    eng = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16")
    step, _, _ = engine_decode(eng, 1, 512, rng, args.steps)
    seqs = inject(eng, 1, 512, rng, max_tokens=8)
    sched = SchedulerOutput("decode", [ScheduledSeq(s, 1, True) for s in seqs], [])
    r = eng.runner
    t_build = timeit(lambda: r.build_input(sched, 1)[0], reps=50)
    inp, _ = r.build_input(sched, 1)
    t_jit = timeit(lambda: r.run(inp), reps=30)

    def ten():
        for _ in range(10):
            out = r.run(inp)
        return out

    t_ten = timeit(ten, reps=5) / 10
    # Weight streaming alone: the MLP + attention projections as a scan-free chain of GEMVs.
    ws = [l for l in jax.tree.leaves(params) if l.ndim == 2 and l.shape[0] != cfg.vocab_size]
    x = jnp.ones((1, cfg.hidden_size), jnp.bfloat16)

    @jax.jit
    def gemvs(ws, x):
        acc = jnp.zeros((), jnp.float32)
        for w in ws:
            xi = x if w.shape[1] == x.shape[1] else jnp.ones((1, w.shape[1]), x.dtype)
            acc = acc + jnp.einsum("bd,fd->bf", xi, w, preferred_element_type=jnp.float32).sum()
        return acc

    t_gemv = timeit(lambda: gemvs(ws, x), reps=20)
    gb = sum(w.size * 2 for w in ws)
    # GPU busy time (profiler kernel records) against wall time: for one step, and for one
    # num_scheduler_steps call (a lax.scan over steps: idle time there is the XLA while
    # loop's per-iteration host round trip and launch gaps, not bytes).
    from gpu_trace import device_times

    gpu = jax.default_backend() == "gpu"  # the profiler's kernel records exist on GPU only
    one = device_times(lambda: r.run(inp), [()], reps=10) if gpu else None
    busy_one = one and one["busy_us"] / 1e3
    n = 8
    eng8 = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16", sched_steps=n)
    seqs8 = inject(eng8, 1, 512, rng, max_tokens=64)
    assert all(eng8.blocks.ensure_slots(s, 512 + n) for s in seqs8)
    inp8, _ = eng8.runner.build_input(SchedulerOutput("decode", [ScheduledSeq(s, 1, True) for s in seqs8], []), 1)
    t_multi = timeit(lambda: eng8.runner.run(inp8, n), reps=10)
    multi = device_times(lambda: eng8.runner.run(inp8, n), [()], reps=5) if gpu else None
    busy_multi = multi and multi["busy_us"] / 1e3
    # A whole target forward (every layer + lm_head + sampling) verifying 8 tokens vs
    # decoding 1, batch 1, by GPU time: the engine-level counterpart of the attention-only
    # verify-8 / decode ratio in scripts/bench_attention.py.
    verify = {}
    if gpu:
        for ctx in (512, 4096):
            e = make_engine(cfg, params, max_num_seqs=8, ctx=ctx, dtype="bfloat16")
            for q in (1, 8):
                verify[f"ctx{ctx}_q{q}_gpu_ms"] = target_forward_time(e, 1, ctx, rng, q, gpu_time=True) * 1e3
            verify[f"ctx{ctx}_ratio"] = verify[f"ctx{ctx}_q8_gpu_ms"] / verify[f"ctx{ctx}_q1_gpu_ms"]
            del e
    out = dict(engine_step_ms=step * 1e3, build_input_ms=t_build * 1e3, jit_step_ms=t_jit * 1e3, target_verify8=verify,
               jit_step_gpu_busy_ms=busy_one, multi_call_steps=n, multi_call_ms=t_multi * 1e3,
               multi_call_gpu_busy_ms=busy_multi,
               pipelined_step_ms=t_ten * 1e3, gemv_chain_ms=t_gemv * 1e3, gemv_TBps=gb / t_gemv / 1e12,
               roofline_ms=(wbytes + 512 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2) / (bw["best_TBps"] * 1e12) * 1e3,
               attn_impl=r.plan.attn, linear_impl=r.plan.linear, xla_flags=os.environ.get("XLA_FLAGS", ""),
               # where one step's GPU time goes: us per step by kernel name, and the number of launches
               step_kernels_us={k: v / n for k, v in list(multi["kernels_us"].items())[:24]} if gpu else None)
    print("diag", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items() if k != "step_kernels_us"},
          flush=True)
    for k, v in (out["step_kernels_us"] or {}).items():
        print(f"  {v:8.1f} us/step  {k}", flush=True)
    return out


def verify_section(args, bw):
    """T(K+1) / T(1) of the target forward (every layer, lm_head and sampling) at batch 1,
    context 512, for K + 1 in {4, 8, 16}: by GPU time (the profiler's kernel records, what
    the step costs the device) and by wall clock (one synchronised call, host included)."""
    gpu = jax.default_backend() == "gpu"
    rows = []
    for name, cfg in (("llama-8b", LLAMA_8B), ("qwen3-8b", QWEN3_8B)):
        cfg = TINY if args.quick else cfg
        params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
        rng = np.random.default_rng(0)
        eng = make_engine(cfg, params, max_num_seqs=8, ctx=512, dtype="bfloat16")
        t = {q: (target_forward_time(eng, 1, 512, rng, q, gpu_time=gpu), target_forward_time(eng, 1, 512, rng, q))
             for q in (1, 4, 8, 16)}
        for q in (4, 8, 16):
            row = dict(model=name, q=q, gpu_ms=t[q][0] * 1e3, gpu_t1_ms=t[1][0] * 1e3, ratio_gpu=t[q][0] / t[1][0],
                       wall_ms=t[q][1] * 1e3, wall_t1_ms=t[1][1] * 1e3, ratio_wall=t[q][1] / t[1][1])
            rows.append(row)
            print(f"verify {name} Q={q:2d}: GPU {row['gpu_ms']:.3f} / {row['gpu_t1_ms']:.3f} ms = {row['ratio_gpu']:.3f}; "
                  f"wall {row['wall_ms']:.3f} / {row['wall_t1_ms']:.3f} ms = {row['ratio_wall']:.3f}", flush=True)
        del eng, params
    return dict(rows=rows)


def drafter_setup(kind, cfg, quick):
    """(DrafterConfig, random params) for a Llama-8B EAGLE3 head, a Qwen3 DFlash or PEagle."""
    from jspec.drafters.loader import drafter_param_spec

    dc = drafter_config(kind, cfg, quick)
    return dc, random_tree(drafter_param_spec(dc), jnp.bfloat16, 1)


def drafter_config(kind, cfg, quick):
    """The DrafterConfig of a Llama-8B EAGLE3 head (32K draft vocabulary), a Qwen3-8B DFlash
    (5 layers, block 16) or PEagle (4 layers), tiny layers with --quick."""
    from jspec.drafters.config import DrafterConfig

    L = cfg.num_layers
    common = dict(
        family=cfg.family, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope=cfg.rope, target_vocab_size=cfg.vocab_size,
        target_hidden_size=cfg.hidden_size, norm_before_fc=False, qk_norm=cfg.qk_norm,
        attention_bias=False, mlp_bias=False, num_speculative_tokens=None,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if kind == "eagle3":
        dc = DrafterConfig(method="eagle3", source_format="speculators", num_layers=1,
                           draft_vocab_size=256 if quick else 32000, aux_layer_ids=(2, L // 2, L - 3),
                           norm_before_residual=True, has_own_embeddings=False, has_d2t=True,
                           mask_token_id=None, block_size=None, **common)
    elif kind == "peagle":
        dc = DrafterConfig(method="peagle", source_format="speculators", num_layers=2 if quick else 4,
                           draft_vocab_size=cfg.vocab_size, aux_layer_ids=(2, L // 2, L - 3),
                           norm_before_residual=False, has_own_embeddings=True, has_d2t=False,
                           mask_token_id=cfg.vocab_size - 1, block_size=None, **common)
    else:  # DFlash layers are Qwen3-style (q/k norms) whatever the target
        common.update(family="qwen3", qk_norm=True)
        dc = DrafterConfig(method="dflash", source_format="speculators", num_layers=2 if quick else 5,
                           draft_vocab_size=cfg.vocab_size, aux_layer_ids=(1, L // 4, L // 2, 3 * L // 4, L - 1),
                           norm_before_residual=False, has_own_embeddings=False, has_d2t=False,
                           mask_token_id=cfg.vocab_size - 1, block_size=16, **common)
    return dc


def drafter_stream_bytes(cfg, dc, dparams) -> int:
    """Bytes a drafter streams per speculative step at small batch: its own weights, plus
    the target's lm_head when it borrows it (DFlash without its own head); embeddings
    are gathered, not streamed (but a draft model's tied table is its lm_head too)."""
    tied = dc.draft_model is not None and dc.draft_model.tie_word_embeddings
    n = weight_bytes(dparams, skip=() if tied else ("embed_tokens",))
    if dc.uses_target_lm_head:
        n += cfg.vocab_size * cfg.hidden_size * 2  # bf16
    return n


def physical_ideal(tau, t1, drafter_bytes, bw_bytes_per_s) -> float:
    """The speculative speedup bound: verification at the cost of one decode step, the
    drafter streaming its weights once per step: tau * T(1) / (T(1) + bytes / bandwidth)."""
    return tau * t1 / (t1 + drafter_bytes / bw_bytes_per_s)


def spec_section(args, bw, kind):
    cfg = TINY if args.quick else (LLAMA_8B if kind == "eagle3" else QWEN3_8B)
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    ctx = 256 if args.quick else 512
    plan = {  # method -> [(K, [acceptance lengths])]
        "eagle3": [(3, [2.5, 3.5]), (7, [2.5, 3.5])],
        "peagle": [(7, [3.5])],
        "dflash": [(15, [4.24, 6.5])],
    }[kind]
    dc, dparams = drafter_setup(kind, cfg, args.quick)
    dbytes = drafter_stream_bytes(cfg, dc, dparams)
    t_dbound = dbytes / (bw["best_TBps"] * 1e12)
    base = make_engine(cfg, params, max_num_seqs=32 if not args.quick else 4, ctx=ctx, dtype="bfloat16")
    rows = []
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else (1, 4)
    ks = {int(k) for k in args.ks.split(",")} if args.ks else None
    for B in batches:
        t1, base_tps, _ = engine_decode(base, B, ctx, rng, args.steps)
        for K, lengths in plan:
            if ks is not None and K not in ks:
                continue
            # T(K+1) / T(1) of the target forward by GPU time on a GPU (wall clock elsewhere).
            gpu = jax.default_backend() == "gpu"
            tK = target_forward_time(base, B, ctx, rng, K + 1, gpu_time=gpu)
            t1_fwd = target_forward_time(base, B, ctx, rng, 1, gpu_time=gpu)
            spec = {"method": kind, "model": f"random-{kind}", "num_speculative_tokens": K,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": lengths[0]}
            eng = make_engine(cfg, params, max_num_seqs=32 if not args.quick else 4, ctx=ctx, dtype="bfloat16",
                              spec=spec, drafter=(dc, dparams), extra=(args.steps + 8) * (K + 1) + 64)
            t_draft = draft_time(eng, B, ctx, rng, K)
            if args.kernels and jax.default_backend() == "gpu":
                prof = spec_step_kernels(eng, B, ctx, rng, K)
                print(f"{kind} B={B} K={K} one step: GPU busy {prof['busy_us']:.1f} us", flush=True)
                for name, us in prof["kernels_us"].items():
                    print(f"  {us:8.1f} us  {name[:110]}", flush=True)
            for length in lengths:
                from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

                eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
                eng.spec_metrics.__init__()
                step, tps, _ = engine_decode(eng, B, ctx, rng, args.steps)
                tau = eng.spec_metrics.mean_acceptance_length
                ideal = physical_ideal(tau, t1, dbytes, bw["best_TBps"] * 1e12)
                rows.append(dict(method=kind, batch=B, K=K, synthetic_length=length, tau=tau, tok_s=tps,
                                 base_tok_s=base_tps, speedup=tps / base_tps, ideal=ideal,
                                 measured_over_ideal=(tps / base_tps) / ideal, t_target1_ms=t1 * 1e3,
                                 t_targetK1_ms=tK * 1e3, t_target1_fwd_ms=t1_fwd * 1e3, t_draft_ms=t_draft * 1e3, draft_bound_ms=t_dbound * 1e3,
                                 drafter_bytes=dbytes, spec_step_ms=step * 1e3))
                print(f"{kind} B={B:2d} K={K:2d} L={length}: tau {tau:.2f} {tps:8.1f} tok/s (base {base_tps:7.1f}) "
                      f"speedup {tps/base_tps:4.2f}x physical ideal {ideal:4.2f}x -> {(tps/base_tps)/ideal:5.1%}; "
                      f"T1 {t1*1e3:.2f}; forward T(K+1) / T(1) {tK*1e3:.2f} / {t1_fwd*1e3:.2f} ms ({tK/t1_fwd:.3f}x) Tdraft {t_draft*1e3:.2f} ms "
                      f"(bytes/bw {t_dbound*1e3:.2f} ms, {t_draft/t_dbound:.2f}x)", flush=True)
            del eng
    return dict(rows=rows)


def llm_run(llm, B, ctx, new, rng, structured=None, reps=None):
    """Seconds of llm.generate for B fresh random prompts of ctx tokens and ``new`` greedy
    tokens each (prefill included), and of the same with 1 new token (prefill alone), under
    the StructuredOutputsParams ``structured`` when given;
    returns (total_s, prefill_s), each the median of ``reps`` timed runs (LLM_REPS, --llm-reps:
    with speculation the rows finish at random steps, so one run's tail is a noisy sample).
    Untimed runs of the same shapes come first, until one compiles nothing new: with
    speculation, rows finish at different steps, so the batch and page-table buckets a run
    passes through vary from run to run. A timed run that still compiled is run again."""
    import jspec

    reps = reps or LLM_REPS
    V, r = llm.engine.model_cfg.vocab_size, llm.engine.runner
    prompts = lambda: [[int(t) for t in rng.integers(0, V, ctx)] for _ in range(B)]  # noqa: E731
    times = []
    for n in (new, 1):
        sp = jspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=structured)
        for _ in range(4):
            c0 = r.num_compilations
            llm.generate(prompts(), sp, use_tqdm=False)
            if r.num_compilations == c0:
                break
        ts = []
        for _ in range(reps + 3):  # up to 3 runs that compiled, timed again
            p, c0 = prompts(), r.num_compilations
            t = time.perf_counter()
            outs = llm.generate(p, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert all(len(o.token_ids) == n for o in outs)
            if r.num_compilations == c0:
                ts.append(dt)
            else:
                print(f"  (B={B}: {r.num_compilations - c0} shape(s) compiled inside a timed run: timed again)")
            if len(ts) == reps:
                break
        if reps > 1:
            print(f"  (B={B}, {n} new tokens: runs {', '.join(f'{t:.3f}' for t in ts)} s)")
        times.append(statistics.median(ts or [dt]))
    if times[0] <= times[1]:  # tiny shapes on a busy CPU: the decode time is under the timing noise
        print(f"  (B={B}: the {new}-token run took no longer than the 1-token run ({times[0]:.3f} <= "
              f"{times[1]:.3f} s): the decode figures derived from them are noise, not measurements)")
    return times[0], times[1]


def llm_engine_kwargs(batches, ctx: int, new: int, ahead: int) -> dict:
    """jspec.LLM's keywords of the llm / moe sections: random bf16 weights, no prefix caching,
    and a fixed page pool, what the largest batch needs with ``ahead`` slots a sequence for
    the drafts and the drafter's lookahead: sized from free memory, the plain engine would
    leave none for the speculative one after it."""
    num_pages = max(batches) * (-(-(ctx + new + 64 + ahead) // 16) + 2) + 8
    return dict(dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches), enable_prefix_caching=False,
                max_model_len=ctx + new + 64, num_pages=num_pages, linear_impl=LINEAR_IMPL, attn_impl=ATTN_IMPL)


def llm_section(args, bw):
    """Through jspec.LLM, the path users take: folders holding only config.json (the 8B shapes,
    scripts/bench_llm_folders.py), random weights by load_format="dummy", prompts of --llm-ctx
    random tokens, --llm-new greedy tokens, timed by LLM.generate with the prefill included and
    without (minus a 1-token run). Speculation with synthetic acceptance; the speedup over the
    plain engine of the same run against the physical ideal tau * T(1) / (T(1) + drafter bytes
    / bandwidth), T(1) the plain engine's decode time per step at that batch."""
    import tempfile

    from bench_llm_folders import write_folders, write_target_folder

    import jspec
    from jspec.drafters.loader import drafter_param_spec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    plan = {"eagle3": [(3, [2.5, 3.5]), (7, [3.5, 5.0])], "peagle": [(7, [3.5])], "dflash": [(15, [4.24, 6.5])],
            "ngram": [(3, [2.5, 3.5]), (7, [3.5, 5.0])],  # ngram: no drafter weights, its ideal is tau
            "draft_model": [(3, [2.5, 3.5])]}  # Llama-3.2-1B's shape drafting for Llama-3.1-8B's
    ks = {int(k) for k in args.ks.split(",")} if args.ks else None
    rows, root = [], tempfile.mkdtemp(prefix="jspec_bench_llm_")
    rng = np.random.default_rng(0)
    common = llm_engine_kwargs(batches, ctx, new, ahead=2 * 17)
    plain_cache = {}
    for kind in args.methods.split(","):
        cfg = TINY if args.quick else (LLAMA_8B if kind in ("eagle3", "ngram", "draft_model") else QWEN3_8B)
        # ngram / draft_model: the target folder only from here
        dc = drafter_config("eagle3" if kind in ("ngram", "draft_model") else kind, cfg, args.quick)
        tdir, ddir = write_folders(root, cfg, dc, 3)
        if kind == "draft_model":
            ddir = write_target_folder(os.path.join(root, "draft-model"),
                                       dataclasses.replace(TINY, num_layers=2) if args.quick else LLAMA_1B)
        if cfg.family not in plain_cache:  # plain decode of this target, per batch
            llm = jspec.LLM(tdir, **common)
            plain_cache[cfg.family] = {}
            for B in batches:
                tot, pf = llm_run(llm, B, ctx, new, rng)
                plain_cache[cfg.family][B] = (tot, pf)
                print(f"llm plain {cfg.family} B={B:2d}: {B * new / tot:8.1f} tok/s with prefill ({tot:.3f} s, "
                      f"prefill {pf:.3f} s), decode {(tot - pf) / (new - 1) * 1e3:.2f} ms/step", flush=True)
            del llm
            gc.collect()  # the engine's jitted methods hold it in reference cycles: free its buffers now
        for K, lengths in plan[kind]:
            if ks is not None and K not in ks:
                continue
            spec = {"method": kind, **({} if kind == "ngram" else {"model": ddir}), "num_speculative_tokens": K,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": lengths[0]}
            llm = jspec.LLM(tdir, speculative_config=spec, **{**common, "max_model_len": ctx + new + 64 + 2 * (K + 1)})
            eng = llm.engine
            dbytes = drafter_stream_bytes(cfg, eng.dcfg, eng.runner.dparams)
            if kind not in ("ngram", "draft_model"):
                assert {s.path for s in drafter_param_spec(eng.dcfg)}  # the dummy tree follows the spec
            for length in lengths:
                eng.runner.synthetic_rates = jnp.asarray(
                    conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
                for B in batches:
                    eng.spec_metrics.__init__()
                    tot, pf = llm_run(llm, B, ctx, new, rng)
                    tau = eng.spec_metrics.mean_acceptance_length
                    ptot, ppf = plain_cache[cfg.family][B]
                    t1 = (ptot - ppf) / (new - 1)
                    ideal = physical_ideal(tau, t1, dbytes, bw["best_TBps"] * 1e12)
                    dec = (ptot - ppf) / (tot - pf)
                    row = dict(method=kind, batch=B, K=K, synthetic_length=length, tau=tau, ctx=ctx, new=new,
                               tok_s=B * new / tot, plain_tok_s=B * new / ptot, speedup_e2e=ptot / tot,
                               speedup_decode=dec, ideal=ideal, of_ideal=dec / ideal, t1_ms=t1 * 1e3,
                               draft_bound_ms=dbytes / (bw["best_TBps"] * 1e12) * 1e3, drafter_bytes=dbytes)
                    rows.append(row)
                    print(f"llm {kind} B={B:2d} K={K:2d} L={length}: tau {tau:.2f} {row['tok_s']:8.1f} tok/s with "
                          f"prefill (plain {row['plain_tok_s']:7.1f}, {row['speedup_e2e']:.2f}x); decode speedup "
                          f"{dec:.2f}x, physical ideal {ideal:.2f}x -> {dec / ideal:5.1%} (T1 {t1 * 1e3:.2f} ms, "
                          f"drafter bytes/bw {row['draft_bound_ms']:.2f} ms)", flush=True)
            del llm, eng
            gc.collect()
    return dict(rows=rows)


def moe_active_bytes(c, itemsize: int = 2) -> int:
    """Weight bytes one decode token streams through a MoE target: every attention and norm
    weight, the routers, num_experts_per_tok experts a layer, the lm_head and one embedding row."""
    H = c.hidden_size
    attn = H * (c.q_size + 2 * c.kv_size) + c.q_size * H + 2 * H + (2 * c.head_dim if c.qk_norm else 0)
    moe = c.num_experts * H + c.num_experts_per_tok * 3 * H * c.moe_intermediate_size
    return itemsize * (c.num_layers * (attn + moe) + c.vocab_size * H + 2 * H)


def moe_section(args, bw):
    """A Qwen3 mixture-of-experts target (Qwen3-30B-A3B's shape, random bf16 weights) through
    jspec.LLM: plain decode per batch against the bytes one token's experts stream (the
    batch-1 bound; a batch's rows pick more experts), and n-gram speculation with synthetic
    acceptance at batch 1 (no drafter weights: its ideal is tau), whose K + 1 verified tokens
    route to more experts than one."""
    import tempfile

    from bench_llm_folders import write_target_folder

    import jspec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    cfg = dataclasses.replace(TINY, family="qwen3", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, moe_layers=tuple(range(TINY.num_layers))) \
        if args.quick else QWEN3_30B_A3B
    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    folder = write_target_folder(os.path.join(tempfile.mkdtemp(prefix="jspec_bench_moe_"), "target"), cfg)
    common = llm_engine_kwargs(batches, ctx, new, ahead=2 * 4)  # the n-gram rows: 2 (K + 1), K = 3
    rng, rows = np.random.default_rng(0), []
    active = moe_active_bytes(cfg)
    bound_ms = active / (bw["best_TBps"] * 1e12) * 1e3
    print(f"moe {cfg.num_layers} layers x {cfg.num_experts} experts ({cfg.num_experts_per_tok} a token): "
          f"{cfg.num_params() / 1e9:.1f}B parameters, {active / 1e9:.2f} GB streamed per token "
          f"({bound_ms:.2f} ms at the probe)", flush=True)
    llm = jspec.LLM(folder, **common)
    plain = {}
    for B in batches:
        tot, pf = llm_run(llm, B, ctx, new, rng)
        t1 = (tot - pf) / (new - 1)
        plain[B] = (tot, pf, t1)
        rows.append(dict(method="plain", batch=B, tok_s=B * new / tot, t1_ms=t1 * 1e3, bound_ms=bound_ms,
                         of_bound=bound_ms / (t1 * 1e3) if B == 1 else None))
        print(f"moe plain B={B:2d}: {B * new / tot:8.1f} tok/s with prefill (prefill {pf:.3f} s), decode "
              f"{t1 * 1e3:.2f} ms/step" + (f", bound {bound_ms:.2f} ms -> {bound_ms / (t1 * 1e3):5.1%}"
                                           if B == 1 else ""), flush=True)
    del llm
    gc.collect()
    K = 3
    spec = {"method": "ngram", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5}
    llm = jspec.LLM(folder, speculative_config=spec, **{**common, "max_model_len": ctx + new + 64 + 2 * (K + 1)})
    eng = llm.engine
    for length in (2.5, 3.5):
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
        eng.spec_metrics.__init__()
        tot, pf = llm_run(llm, 1, ctx, new, rng)
        tau = eng.spec_metrics.mean_acceptance_length
        ptot, ppf, t1 = plain[1]
        dec = (ptot - ppf) / (tot - pf)
        rows.append(dict(method="ngram", batch=1, K=K, tau=tau, speedup_decode=dec, of_ideal=dec / tau,
                         step_ms=t1 * tau / dec * 1e3))
        print(f"moe ngram B= 1 K={K} L={length}: tau {tau:.2f}, decode speedup {dec:.2f}x, ideal (no drafter "
              f"weights) {tau:.2f}x -> {dec / tau:5.1%}; step {t1 * tau / dec * 1e3:.2f} ms against T(1) "
              f"{t1 * 1e3:.2f} ms", flush=True)
    return dict(rows=rows, active_bytes=active)


# A schema no row can complete within --llm-new tokens (at least 2000 integers), so every row
# runs the full count with and without it.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2000}},
    "required": ["values"], "additionalProperties": False}


def structured_section(args, bw):
    """Structured outputs (issue 27) through jspec.LLM on the Llama 8B shape: random weights
    (load_format="dummy") and a byte-level BPE tokenizer of the model's vocabulary size
    (bench_llm_folders.write_tokenizer), --spec-batches rows of --llm-ctx random prompt tokens
    and --llm-new greedy tokens, tok/s without and with a JSON schema (STRUCTURED_SCHEMA:
    every output token masked by the grammar, its masks built on the host each step)."""
    import tempfile

    from bench_llm_folders import write_folders, write_tokenizer

    import jspec

    ctx, new = (64, 32) if args.quick else (args.llm_ctx, args.llm_new)
    batches = [int(b) for b in args.spec_batches.split(",")] if not args.quick else [1, 2]
    cfg = TINY if args.quick else LLAMA_8B
    tdir, _ = write_folders(tempfile.mkdtemp(prefix="jspec_bench_structured_"), cfg, drafter_config("eagle3", cfg,
                                                                                                    args.quick), 3)
    write_tokenizer(tdir, cfg.vocab_size)
    llm = jspec.LLM(tdir, dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
                    enable_prefix_caching=False, max_model_len=ctx + new + 64, linear_impl=LINEAR_IMPL,
                    attn_impl=ATTN_IMPL)
    so = jspec.StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    rng, rows = np.random.default_rng(0), []
    for B in batches:
        (tot, pf), (stot, spf) = llm_run(llm, B, ctx, new, rng), llm_run(llm, B, ctx, new, rng, so)
        row = dict(batch=B, ctx=ctx, new=new, tok_s=B * new / tot, json_tok_s=B * new / stot,
                   decode_ms=(tot - pf) / (new - 1) * 1e3, json_decode_ms=(stot - spf) / (new - 1) * 1e3)
        row["slowdown"] = 1 - row["json_tok_s"] / row["tok_s"]
        rows.append(row)
        print(f"structured B={B:2d}: {row['tok_s']:8.1f} tok/s plain, {row['json_tok_s']:8.1f} tok/s with the JSON "
              f"schema ({row['slowdown']:+.1%} slower); decode {row['decode_ms']:.2f} -> {row['json_decode_ms']:.2f} "
              f"ms/step", flush=True)
    out = llm.generate([[1, 2, 3]], jspec.SamplingParams(temperature=0, max_tokens=16, structured_outputs=so))[0]
    text, head = "".join(out.outputs[0].text.split()), '{"values":['  # the mask held (whitespace is free)
    assert text.startswith(head) or head.startswith(text), out.outputs[0].text
    return dict(rows=rows)


def spec_step_kernels(eng, B, ctx, rng, K, top=30):
    """Where a speculative step's GPU time goes: one jitted verify + sample + propose call
    (SpecModelRunner.run_spec) at batch B, by the profiler's kernel records."""
    from gpu_trace import device_times

    r = eng.runner
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    sched = verify_schedule(seqs, K + 1)
    r.assign_prob_rows(sched, {s.request_id for s in seqs})
    inp, _, _ = r.build_spec_input(sched)
    t = device_times(lambda: r.run_spec(inp, True), [()], reps=10)
    for s in seqs:
        s.draft_token_ids = []
    clear(eng)
    return dict(busy_us=t["busy_us"], union_us=t["union_us"], kernels_us=dict(list(t["kernels_us"].items())[:top]))


def draft_time(eng, B, ctx, rng, K):
    """Time of the drafter's proposal alone (first pass over K+1 pairs + the rest): the GPU
    busy time by the profiler on a GPU (what it adds to a step), else the wall-clock median.
    Every array is an argument of the jitted call: one closed over would be a constant that
    the call copies (the target's lm_head: 1.2 GB, a 0.47 ms memcpy seen on the H100). The
    drafter's cache is donated and threaded from call to call, as the step does: undonated,
    each call copied it (65 us for EAGLE3's, 0.52 ms for DFlash's at bench.py's pool)."""
    from jspec.drafters.propose import ProposeInputs

    r = eng.runner
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    inp, _ = r.build_input(verify_schedule(seqs, K + 1), K + 1)
    inp = jax.tree.map(jnp.asarray, inp)
    Bp, Q = inp.tokens.shape
    aux = jax.random.normal(jax.random.PRNGKey(3), (Bp, Q, r.dcfg.num_aux * r.cfg.hidden_size), jnp.bfloat16)
    last = jnp.full((Bp,), Q - 1, jnp.int32)
    active = jnp.ones((Bp,), bool)
    temp = jnp.zeros((Bp,), jnp.float32)
    embed, head = r.embedding_table(r.params), r.lm_head_weight(r.params)
    propose = jax.jit(lambda dp, dkv, pin: r.drafter.propose(dp, dkv, pin, num_tokens=K, with_probs=False)[::2],
                      donate_argnums=1)
    pin = ProposeInputs(inp.tokens, aux, inp.meta, last, embed, head, inp.seeds, temp, active)

    def fn():  # the same positions each call: the drafter rewrites the same slots
        drafts, r.dkv = propose(r.dparams, r.dkv, pin)
        return drafts

    t = timeit(fn, reps=15)
    if jax.default_backend() == "gpu":
        from gpu_trace import device_times

        prof = device_times(fn, [()], reps=10)
        print(f"{r.dcfg.method} B={B} K={K} propose alone: GPU busy {prof['busy_us']:.1f} us, "
              f"union {prof['union_us']:.1f} us, wall {t * 1e6:.1f} us", flush=True)
        if PROFILE_DRAFT:
            for name, us in list(prof["kernels_us"].items())[:30]:
                print(f"  {us:8.1f} us  {name[:110]}", flush=True)
        t = prof["busy_us"] / 1e6
    for s in seqs:
        s.draft_token_ids = []
    clear(eng)
    return t


def warmup_section(args, bw):
    """Engine warmup (every shape compiled) of the 8B plain engine at max_num_seqs
    --warm-batch, one compilation at a time and on the plan's threads (RunnerBase.precompile),
    each on a fresh engine with jax's caches cleared (no persistent cache)."""
    cfg = LLAMA_8B
    params = random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rows = []
    for threads in (1, None):
        jax.clear_caches()
        eng = make_engine(cfg, params, max_num_seqs=args.warm_batch, ctx=args.llm_ctx, dtype="bfloat16")
        n = len(eng.warmup_shapes())
        threads = threads or eng.runner.plan.compile_threads
        t = time.perf_counter()
        eng.runner.precompile(eng.warmup_shapes(), threads)
        eng.runner.warmup(1, True)
        t = time.perf_counter() - t
        rows.append(dict(threads=threads, shapes=n, seconds=t, compilations=eng.runner.num_compilations))
        print(f"warmup, {n} shapes, {threads} compile thread(s): {t:.1f} s", flush=True)
        del eng
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", choices=["plain", "diag", "verify", "llm", "moe", "structured", "warmup", "eagle3",
                                         "parallel", "all"],
                    default="plain")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,8,32,64", help="plain section: batch sizes")
    ap.add_argument("--contexts", default="512,4096", help="plain section: contexts (the first one also gets "
                    "the batch-1 rows without async / with one step per call)")
    ap.add_argument("--sched-steps", type=int, default=8, help="num_scheduler_steps for the plain section")
    ap.add_argument("--no-sync-rows", action="store_true", help="plain section: skip the async-off batch-1 row")
    ap.add_argument("--linear-impl", default="auto", help="EngineConfig.linear_impl (auto | reference | gpu)")
    ap.add_argument("--attn-impl", default="auto", help="EngineConfig.attn_impl (auto | reference | gpu | tpu)")
    ap.add_argument("--spec-batches", default="1,32", help="eagle3/parallel sections: batch sizes")
    ap.add_argument("--ks", default="", help="eagle3/parallel sections: only these K (default: the plan's)")
    ap.add_argument("--methods", default="dflash,peagle", help="parallel / llm sections: which drafters")
    ap.add_argument("--llm-ctx", type=int, default=512, help="llm section: prompt tokens")
    ap.add_argument("--llm-new", type=int, default=256, help="llm section: generated tokens")
    ap.add_argument("--warm-batch", type=int, default=4, help="warmup section: max_num_seqs")
    ap.add_argument("--llm-reps", type=int, default=1, help="llm / structured sections: timed runs per figure "
                    "(their median; each run's time printed when more than one)")
    ap.add_argument("--kernels", action="store_true", help="eagle3/parallel sections: profile one speculative "
                    "step per (batch, K) and print its GPU time by kernel")
    args = ap.parse_args()
    global LINEAR_IMPL, ATTN_IMPL
    LINEAR_IMPL, ATTN_IMPL = args.linear_impl, args.attn_impl
    global PROFILE_DRAFT, LLM_REPS
    PROFILE_DRAFT, LLM_REPS = args.kernels, args.llm_reps
    info = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                backend=jax.default_backend(), xla_flags=os.environ.get("XLA_FLAGS", ""), linear_impl=LINEAR_IMPL,
                attn_impl=ATTN_IMPL)
    print(info, flush=True)
    bw = measure_bandwidth(args.quick)
    print("bandwidth", {k: round(v, 3) for k, v in bw.items()}, flush=True)
    results = dict(info=info, bandwidth=bw)
    if args.section == "diag":
        results["diag"] = diag_section(args, bw)
    if args.section == "llm":
        results["llm"] = llm_section(args, bw)
    if args.section == "verify":
        results["verify"] = verify_section(args, bw)
    if args.section == "moe":
        results["moe"] = moe_section(args, bw)
    if args.section == "structured":
        results["structured"] = structured_section(args, bw)
    if args.section == "warmup":
        results["warmup"] = warmup_section(args, bw)
    if args.section in ("plain", "all"):
        results["plain"] = plain_section(args, bw)
        # The probe again at the end, warm: the rooflines use the best of both.
        bw_end = measure_bandwidth(args.quick)
        print("bandwidth at the end", {k: round(v, 3) for k, v in bw_end.items()}, flush=True)
        results["bandwidth_end"] = bw_end
        best = max(bw["best_TBps"], bw_end["best_TBps"])
        print(f"plain rows against the best probe of the run, {best:.3f} TB/s:")
        for r in results["plain"]["rows"]:
            r["roofline_ms"] = r["roofline_bytes"] / (best * 1e12) * 1e3
            r["roofline_frac"] = r["roofline_ms"] / r["step_ms"]
            r["probe_TBps"] = best
            print(f"  B={r['batch']:3d} ctx={r['ctx']:5d} steps={r['num_scheduler_steps']} async={int(r['async_scheduling'])}: "
                  f"{r['step_ms']:6.2f} ms {r['tok_s']:8.1f} tok/s roofline {r['roofline_ms']:5.2f} ms -> "
                  f"{r['roofline_frac']:5.1%}", flush=True)
    if args.section in ("eagle3", "all"):
        results["eagle3"] = spec_section(args, bw, "eagle3")
    if args.section in ("parallel", "all"):
        for m in args.methods.split(","):
            results[m] = spec_section(args, bw, m)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"bench_{args.section}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
