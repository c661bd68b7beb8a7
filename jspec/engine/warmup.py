"""Warmup: an executable for every call a step of a ``FlatRunner`` can make, made before the
first request.

``warmup_calls`` lists the calls (one per shape of ``FlatRunner.warmup_shapes``, and the
masked and split steps of a batch with a grammar), on empty inputs: every write dropped, so
the caches keep their contents. ``prepare`` makes each call's executable: loaded whole from
disk when this code, configuration and device compiled it before
(jspec/engine/executables.py), else lowered and compiled, several at once, into the
runner's map (``exe_key``) that ``FlatRunner._invoke`` reads. ``run_warmup`` does both and
runs every call once; ``time_decode_calls`` times the decode programs for dynamic speculation.
"""

from __future__ import annotations

import logging
import threading
import time

import jax

from jspec.engine.executables import Store, compile_and_keep, stable_repr
from jspec.engine.flat_input import FlatInput, FlatShape, row_width
from jspec.engine.flat_runner import FlatRunner, exe_key
from jspec.engine.sampling_step import Split, allow_all, empty_sample_input
from jspec.engine.scheduler import SchedulerOutput

# The thread warm_engine writes its compiled steps on (benchmarks join it before timing:
# scripts/bench_common.py settle)
WRITER_THREAD = "jspec-keep-steps"

logger = logging.getLogger("jspec.engine")


def empty_input(runner: FlatRunner, shape: FlatShape) -> FlatInput:
    """An input of ``shape`` with no sequence (num_seqs 0, every slot dropped): compiles a
    shape without touching the caches."""
    return runner.build(SchedulerOutput("decode" if shape.decode else "prefill", [], []), shape)


def warmup_calls(runner: FlatRunner, num_scheduler_steps: int = 1, async_scheduling: bool = False,
                 structured: bool = False, shapes=None):
    """Every call warmup makes, as a list of ``make``: ``make()`` -> (jitted function's
    name, arguments, static keywords), built when it runs (its arguments hold the state
    then), or ("split", shape, None): the tail of the forward made just before it.
    ``shapes``: the unmasked calls' shapes (default: every one of ``runner.warmup_shapes``).
    ``structured``: also the masked steps a batch with a grammar takes (one step per call; a
    chained one split in two: the forward, then the tail, whose input is the forward's
    output)."""
    r, V = runner, runner.cfg.vocab_size
    every = r.warmup_shapes(num_scheduler_steps, async_scheduling)
    calls = [(lambda sh=sh: r._call(empty_input(r, sh), sh.steps, None, sh.filtering)) for sh in shapes or every]
    for sh in every if structured else ():
        if sh.decode and row_width(sh) != r.shapes.q:  # a batch with a grammar verifies every draft (dynamic_spec)
            continue
        if sh.steps <= 1:
            calls.append(lambda sh=sh: r._call(empty_input(r, sh).replace(
                grammar_mask=allow_all(sh.seqs, r.shapes.q, V)), sh.steps, None, sh.filtering))
        if sh.steps == 1:  # (the forward is one program either way of filtering)
            calls.append(lambda sh=sh: r._forward_call(empty_input(r, sh), r._no_prev_for(sh.seqs, 1)))
            calls.append(lambda sh=sh: ("split", sh, None))  # (name, its shape, no keywords)
    return calls


def lower_shape(runner: FlatRunner, shape: FlatShape):
    """Warmup's call for ``shape``, lowered."""
    name, args, kw = runner._call(empty_input(runner, shape), shape.steps, None, shape.filtering)
    return getattr(runner, name).lower(*args, **kw)


def prepare(runner: FlatRunner, calls, threads: int = 1, store: Store | None = None,
            progress: bool = False) -> tuple[int, int]:
    """An executable for each of ``calls`` (``warmup_calls``) in ``runner._executables``:
    loaded from ``store`` when there (one at a time: XLA:CPU's executables loaded on two
    threads at once failed to run, "Function ... not found", jax 0.10.2), else lowered here
    and compiled on ``threads`` threads (tracing and lowering hold the GIL; XLA's compiler
    releases it, so compilations overlap each other and the next call's tracing: an 8B
    step takes seconds to compile on a GPU), then kept in the store. A split step's tail
    waits for its forward to run (``run_warmup``). ``progress``: a progress bar (vLLM's
    graph capture shows one). -> (compiled, loaded)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    context = trace_context(runner) if store is not None else ""
    loads, compiles, load_s = [], [], 0.0
    with ThreadPoolExecutor(max(threads, 1)) as pool, tqdm(
            total=len(calls), desc="compiling steps", unit="step", disable=not progress) as bar:

        def compile_later(slot, name, args, kw, key):
            lowered = getattr(runner, name).lower(*args, **kw)
            job = pool.submit(compile_and_keep, store, key, lowered, runner.compile_options(kw))
            job.add_done_callback(lambda _: bar.update(1))
            compiles.append((slot, job))

        for make in calls:
            name, args, kw = make()
            slot = None if name == "split" else exe_key(name, kw)
            if slot is None or slot in runner._executables:
                bar.update(1)
                continue
            key = store.key(context, name, args, kw) if store is not None else None
            t = time.monotonic()
            exe = store.load(key) if key is not None else None
            load_s += time.monotonic() - t
            if exe is not None:
                runner._executables[slot] = exe
                loads.append(slot)
                bar.update(1)
            else:  # not stored, or damaged: compiled (again)
                compile_later(slot, name, args, kw, key)
        for slot, job in compiles:
            runner._executables[slot] = job.result()
    runner.num_loaded += len(loads)
    if loads:
        logger.debug("loaded %d stored steps in %.1f s", len(loads), load_s)
    return len(compiles), len(loads)


def trace_context(r: FlatRunner) -> str:
    """What the jitted functions read of the runner while tracing, as a stable string
    (part of an executable's key on disk)."""
    return stable_repr((r.cfg, r.dcfg, r.spec, r.plan, r.K, r.page_size, r.num_pages, r.width, r.shapes,
                        r.eos_token_ids, r.n_top_logprobs, r.logprobs_mode, r.with_probs, r.aux_layers,
                        r.model, r.drafter))


def run_warmup(runner: FlatRunner, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None,
               structured: bool = False, threads: int = 1, store: Store | None = None,
               progress: bool = False) -> tuple[int, int]:
    """Run every call of ``warmup_calls`` once on empty inputs, each through the
    executable ``prepare`` made for it. -> (compiled, loaded) by ``prepare``."""
    r = runner
    calls = warmup_calls(r, num_scheduler_steps, async_scheduling, structured, shapes)
    compiled, loaded = prepare(r, calls, threads, store, progress)
    fwd = None
    for make in calls:
        name, *rest = make()
        if name == "split":  # the tail of the last forward run
            sh = rest[0]
            split = Split(fwd, sh.seqs, r.K + 1, r.width * r.page_size)

            def tail(split=split, sh=sh):
                return r._tail_call(split, empty_sample_input(sh.seqs, r.K + 1, r.cfg.vocab_size), sh.filtering)

            c, n = prepare(r, [tail], 1, store)
            compiled, loaded = compiled + c, loaded + n
            r.state, _ = r._invoke(*tail())
            continue
        r.state, out = r._invoke(name, *rest)
        fwd = out if name == "_fwd" else fwd
    jax.block_until_ready(r.state)
    return compiled, loaded


def time_decode_calls(runner: FlatRunner, shapes) -> dict[tuple[int, int], float]:
    """Seconds of each decode program among ``shapes`` (without top-k / top-p filtering) on
    empty rows, one run each after warmup's (compiled and run once already): dynamic
    speculation's step times before any request (jspec/engine/dynamic_spec.py).
    -> {(row width Q, batch bucket N): seconds}."""
    out = {}
    for sh in shapes:
        if not sh.decode or sh.filtering != "off":
            continue
        t = time.perf_counter()
        runner.state, res = runner._invoke(*runner._call(empty_input(runner, sh), sh.steps, None, sh.filtering))
        jax.block_until_ready(res)
        out[(row_width(sh), sh.seqs)] = time.perf_counter() - t
    return out


def warm_engine(eng, progress: bool = False):
    """LLMEngine.warmup: every step's executable loaded from disk when this code, model,
    configuration and device made it before (with jspec's compilation cache on:
    jspec/engine/executables.py), else compiled (several at once on an accelerator) and
    then written there by a thread of its own; dynamic speculation's decode calls timed.
    ``progress``: a progress bar."""
    t = time.monotonic()
    eng.runner.log_compiles = False
    store = Store.open()
    try:
        compiled, loaded = run_warmup(
            eng.runner, eng.sched_steps, eng.config.async_scheduling, structured=eng.config.warmup_structured_outputs,
            threads=eng.runner.plan.compile_threads, store=store, progress=progress)
        if eng.policy is not None and eng.policy.enabled:
            eng.policy.warm.update(time_decode_calls(eng.runner, eng.warmup_shapes()))
    finally:
        eng.runner.log_compiles = True
        if store is not None:
            # written while the first requests run: serializing an executable holds the host for
            # a moment (the 8B server's 30 steps: 4.1-4.8 s of its start on the H200, 2026-11-30);
            # not a daemon, so the process writes them all before it exits
            threading.Thread(target=store.flush, name=WRITER_THREAD).start()
    logger.info("warmup: %d step programs ready in %.1f s (%d compiled, %d loaded from the cache)",
                compiled + loaded, time.monotonic() - t, compiled, loaded)
