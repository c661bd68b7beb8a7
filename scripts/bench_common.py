"""What the benchmark scripts share: the model shapes (Llama-3.1-8B, Qwen3-8B, Llama-3.2-1B,
Qwen3-30B-A3B, a tiny one for --quick), random device weights, the bandwidth probes, engines
with their sequences injected at a context (random KV), the timed engine loop, the target
forward at a verification width, the drafters' configs and bytes, the physical ideal, and
jspec.LLM's timed generate. scripts/bench.py's sections run on them, as do bench_llm.py,
bench_tp.py, bench_mixed.py, step_profile.py, gpu_check.py's performance table, ...

The settings below are module state set by scripts/bench.py's flags and read at call time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import zlib

import jax
import jax.numpy as jnp

from jspec.checkpoint.target import set_path
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
QUANTIZATION = None  # --quantization fp8: the target's projections as FP8 (EngineConfig.quantization)


def make_engine(cfg, params, *, max_num_seqs, ctx, dtype, spec=None, drafter=None, page_size=16, extra=64,
                sched_steps=1, async_scheduling=True):
    pages_per_seq = -(-(ctx + extra) // page_size) + 2
    ec = EngineConfig(
        model=f"random-{cfg.family}", dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=ctx + extra,
        page_size=page_size, num_pages=max_num_seqs * pages_per_seq + 4, enable_prefix_caching=False,
        speculative_config=spec, num_scheduler_steps=sched_steps, linear_impl=LINEAR_IMPL, attn_impl=ATTN_IMPL,
        async_scheduling=async_scheduling, quantization=QUANTIZATION,
    )
    eng = LLMEngine(ec, preloaded=(cfg, params), preloaded_drafter=drafter)
    # Random KV everywhere: attention must not run on zeros.
    kv = eng.runner.kv
    keys = jax.random.split(jax.random.PRNGKey(7), 2 * len(kv.k))
    rnd = lambda a, k: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)  # noqa: E731
    eng.runner.state = eng.runner.state.replace(kv=type(kv)(k=tuple(rnd(a, k) for a, k in zip(kv.k, keys[::2])),
                                                            v=tuple(rnd(a, k) for a, k in zip(kv.v, keys[1::2]))))
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
    """Compile the decode shapes of a batch of B rows, so that nothing compiles inside the
    timed loop (``ctx``, ``steps``: unused since the page table has one width)."""
    from jspec.engine.buckets import pick
    from jspec.engine.warmup import run_warmup

    r, c = eng.runner, eng.config
    N = pick(r.shapes.batch, B)  # one page-table width: the decode family's shapes of B rows
    run_warmup(r, shapes=[s for s in r.warmup_shapes(c.num_scheduler_steps, eng._async) if s.decode and s.seqs == N])


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


def step_input(eng, sched, q: int = 1, steps: int = 0):
    """The runner's host-built input of ``sched`` (decode rows of q tokens each), for
    ``eng.runner.run(inp, steps)``: its decode family's input when q is its row width (K + 1),
    else its general family's."""
    r = eng.runner
    if q == r.shapes.q:
        return r.build(sched, r.shape_of(sched, steps))
    return r.build(sched, r.shapes.general_shape(sum(x.num_new for x in sched.seqs)))


def target_forward_time(eng, B, ctx, rng, q, gpu_time=False):
    """Time of the jitted target step at Q = q tokens per row (verification width): the
    wall-clock median, or with gpu_time the profiler's GPU busy time (scripts/gpu_trace.py)."""
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    inp = step_input(eng, verify_schedule(seqs, q), q)
    if gpu_time:
        from gpu_trace import device_times
        t = device_times(lambda: eng.runner.run(inp), [()], reps=10)["busy_us"] / 1e6
    else:
        t = timeit(lambda: eng.runner.run(inp), reps=15)
    for s in seqs:
        s.draft_token_ids = []
    clear(eng)
    return t


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



def settle():
    """Wait for jspec's executable writes: warmup hands the steps it compiled to a thread
    (WRITER_THREAD, jspec/engine/warmup.py warm_engine) that serializes them while the
    first requests run, holding the host for ~0.4 s an 8B step (jspec/engine/executables.py).
    A timed run that starts before it ends shares the host with it: steady-state figures wait."""
    import threading

    from jspec.engine.warmup import WRITER_THREAD

    for t in threading.enumerate():
        if t.name == WRITER_THREAD:
            t.join()


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
        settle()
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
                max_model_len=ctx + new + 64, num_pages=num_pages, linear_impl=LINEAR_IMPL, attn_impl=ATTN_IMPL,
                quantization=QUANTIZATION)



def spec_step_kernels(eng, B, ctx, rng, K, top=30):
    """Where a speculative step's GPU time goes: one jitted verify + sample + propose call
    (FlatRunner.run) at batch B, by the profiler's kernel records."""
    from gpu_trace import device_times

    r = eng.runner
    seqs = inject(eng, B, ctx, rng, max_tokens=8)
    sched = verify_schedule(seqs, K + 1)
    r.assign_prob_rows(sched, {s.request_id for s in seqs})
    inp = step_input(eng, sched, K + 1)
    t = device_times(lambda: r.run(inp), [()], reps=10)
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
    inp = jax.tree.map(jnp.asarray, step_input(eng, verify_schedule(seqs, K + 1), K + 1))
    T, N = inp.tokens.shape[0], inp.sample.shape[0]
    aux = jax.random.normal(jax.random.PRNGKey(3), (1, T, r.dcfg.num_aux * r.cfg.hidden_size), jnp.bfloat16)
    last = inp.logits_idx[:, -1]  # every draft accepted: the bonus pair at each row's last token
    active = jnp.ones((N,), bool)
    temp = jnp.zeros((N,), jnp.float32)
    embed, head = r.embedding_table(r.params), r.lm_head_weight(r.params)
    propose = jax.jit(lambda dp, dkv, pin: r.drafter.propose(dp, dkv, pin, num_tokens=K, with_probs=False)[::2],
                      donate_argnums=1)
    pin = ProposeInputs(inp.tokens[None], aux, inp.meta, last, embed, head, inp.seeds, temp, active, inp.tokens[None])

    def fn():  # the same positions each call: the drafter rewrites the same slots
        drafts, dkv = propose(r.dparams, r.dkv, pin)
        r.state = r.state.replace(dkv=dkv)
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

