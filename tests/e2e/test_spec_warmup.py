"""LLMEngine.warmup() with a drafter compiles every speculative shape up front, leaves the
caches untouched, and no request compiles anything afterwards (the server calls warmup
on every accelerator before it serves)."""

from __future__ import annotations

import pytest

import jspec
from jspec.engine.kv_memory import TEMP_RESERVE
from jspec.engine.warmup import lower_shape
from tests.helpers import spec_e2e as h
from tests.helpers.engine import precompile_then_warmup

pytestmark = pytest.mark.production_buckets  # about the real shape buckets (tests/conftest.py)

CASES = [("eagle3", 3, {"draft_sample_method": "probabilistic"}), ("peagle", 3, {}), ("dflash8_zlab", 7, {})]


@pytest.mark.parametrize("name,k,extra", CASES, ids=[c[0] for c in CASES])
def test_warmup_compiles_every_shape_once(name, k, extra):
    prompts = h.varied_prompts(5, 1, 40, seed=7)
    want = h.greedy_reference(prompts, 12)
    # seed=1: a fresh engine (the helpers cache engines by their arguments).
    llm = h.llm(name, k, spec_extra=extra, seed=1)
    eng = llm.engine
    shapes = eng.warmup_shapes()
    b = eng.runner.shapes
    # verification of [N, K + 1] rows (chained or not: async scheduling), the general steps,
    # each without and with top-k / top-p filtering
    assert len(shapes) == 2 * (len(b.batch) + len(b.tokens))
    assert sum(s.decode for s in shapes) == 2 * len(b.batch) and all(
        s.tokens == s.seqs * (k + 1) for s in shapes if s.decode)
    if name == "peagle":  # compiled ahead on two threads, as on an accelerator (jspec/engine/warmup.py, prepare)
        ahead, in_warmup = precompile_then_warmup(eng)
        assert ahead >= len(shapes) and in_warmup == 0
    else:
        eng.warmup()
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)
    outs = llm.generate(prompts, jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert eng.spec_metrics.mean_acceptance_length > 1.3  # drafts were verified, not all rejected
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)


def test_kv_pages_from_memory_count_the_drafter_cache(monkeypatch):
    """On an accelerator the page pool is sized from free memory; with a drafter each page
    also holds the drafter's K/V (the server ran out of memory at warmup without this)."""
    import jax
    import numpy as np

    class Dev:
        def memory_stats(self):
            return {"bytes_limit": 64 << 20, "bytes_in_use": 0}

    folder, _ = h.target()
    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [Dev()])  # kv_memory reads this process's
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the pool: half of a 128 MB device
    # warmup=False: the backend reads as a GPU, where jspec.LLM would compile every step shape
    # first; the pool is sized and allocated before that.
    kw = dict(max_num_seqs=2, max_model_len=56, page_size=16, gpu_memory_utilization=0.5, warmup=False,
              attn_impl="reference", sample_impl="reference", linear_impl="reference")
    plain = jspec.LLM(folder, **kw).engine
    spec = jspec.LLM(folder, speculative_config=h.spec_config("dflash4", 3), **kw).engine
    c = plain.model_cfg
    page = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4  # float32
    d = spec.dcfg
    dpage = 2 * d.num_layers * 16 * d.num_kv_heads * d.head_dim * 4
    budget = (1 - TEMP_RESERVE) * (64 << 20)  # the engine's share (the pool), less the temporaries'
    assert plain.num_pages == int(budget // page)
    assert spec.num_pages == int(budget // (page + dpage)) < plain.num_pages
    kv_bytes = sum(np.prod(a.shape) * a.dtype.itemsize for a in spec.runner.kv.k + spec.runner.kv.v
                   + spec.runner.dkv.k + spec.runner.dkv.v)
    assert kv_bytes <= budget


def test_kv_pool_that_does_not_fit_is_retried_smaller(monkeypatch):
    """A pool sized from memory whose allocation fails (XLA's allocator found no free block
    for its last array: the embedded family on the H200) is allocated again with 5% fewer
    pages, before the engine exists, and the engine then runs; so is one that fails at once
    in the allocation; an error other than out of memory is raised as it is."""
    import jax

    from jspec.kv_cache import KVCache

    class Dev:
        def memory_stats(self):
            return {"bytes_limit": 64 << 20, "bytes_in_use": 0}

    real = jax.block_until_ready
    failures = [jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")] * 2

    def block(x):  # the pool's wait (kv, dkv) fails while ``failures`` last
        if failures and isinstance(x, tuple) and isinstance(x[0], KVCache):
            raise failures.pop()
        return real(x)

    folder, _ = h.target()
    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [Dev()])  # kv_memory reads this process's
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "block_until_ready", block)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the pool: half of a 128 MB device
    # warmup=False: the backend reads as a GPU, where jspec.LLM would compile every step shape
    # first; the pool is sized and allocated before that.
    kw = dict(max_num_seqs=2, max_model_len=56, page_size=16, gpu_memory_utilization=0.5, warmup=False,
              attn_impl="reference", sample_impl="reference", linear_impl="reference")
    llm = jspec.LLM(folder, speculative_config=h.spec_config("dflash4", 3), **kw)
    eng = llm.engine
    c, d = eng.model_cfg, eng.dcfg
    page = 2 * 16 * 4 * (c.num_layers * c.num_kv_heads * c.head_dim + d.num_layers * d.num_kv_heads * d.head_dim)
    sized = int((1 - TEMP_RESERVE) * (64 << 20) // page)
    assert eng.num_pages == sized * 19 // 20 * 19 // 20 and not failures
    assert eng.runner.kv.num_pages == eng.runner.dkv.num_pages == eng.num_pages
    out = llm.generate([[1, 2, 3]], jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    real_create, sizes = KVCache.create.__func__, []

    def create(cls, num_layers, num_pages, *a, **k):  # the first allocation fails at once
        sizes.append(num_pages)
        if len(sizes) == 1:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real_create(cls, num_layers, num_pages, *a, **k)

    monkeypatch.setattr(KVCache, "create", classmethod(create))
    assert jspec.LLM(folder, **kw).engine.num_pages == sizes[0] * 19 // 20 == sizes[1]
    monkeypatch.setattr(KVCache, "create", classmethod(real_create))
    failures.append(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        jspec.LLM(folder, **kw)


def test_a_step_that_fails_on_the_device_leaves_a_working_engine(monkeypatch):
    """A step that fails after its call took the donated buffers (out of memory on the
    device) raises, and the engine goes on: zeroed buffers in their place, its running
    requests preempted and recomputed, the prefix cache empty, every output the greedy one,
    and a prompt sent again finds no stale page. A step that fails on the host before its
    call changes nothing."""
    import jax

    prompts = h.varied_prompts(3, 20, 40, seed=11)
    want = h.greedy_reference(prompts, 12)
    llm = h.llm("eagle3", 3, spec_extra=CASES[0][2], seed=1)  # the warmup test's engine: compiled
    eng, runner = llm.engine, llm.engine.runner
    sp = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"f{i}", p, sp)
    real, calls = runner._invoke, []

    def failing(*a, **k):  # call 3 fails on the host, before the call; call 6 on the device, after it
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("host")
        out = real(*a, **k)
        if len(calls) == 6:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return out

    monkeypatch.setattr(runner, "_invoke", failing)
    done, errors, preempted = {}, [], []
    while eng.has_unfinished_requests():
        buffers, n0 = (runner.kv, runner.dkv, runner.probs_buf), eng.scheduler.num_preemptions
        try:
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        except (RuntimeError, jax.errors.JaxRuntimeError) as e:
            errors.append(str(e))
            replaced = [new is not old for new, old in zip((runner.kv, runner.dkv, runner.probs_buf), buffers)]
            preempted.append((replaced, eng.scheduler.num_preemptions - n0, len(eng.scheduler.running),
                              len(eng.blocks.hash_page), eng.blocks.num_free_pages))
    assert errors[0] == "host" and "RESOURCE_EXHAUSTED" in errors[1]
    replaced, n_preempted, running, cached, free = preempted[0]  # host failure: buffers and requests kept
    assert replaced == [False] * 3 and n_preempted == 0 and running >= 1 and free < eng.num_pages
    replaced, n_preempted, running, cached, free = preempted[1]  # device failure
    assert replaced == [True] * 3 and n_preempted >= 1 and running == cached == 0 and free == eng.num_pages
    assert [done[f"f{i}"] for i in range(3)] == want
    outs = llm.generate(prompts, sp)  # their pages cached again after the failure: hits, same outputs
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_generate_that_fails_leaves_no_request_behind(monkeypatch, exc):
    """LLM.generate interrupted (Ctrl-C in a notebook) or failing in its third step aborts
    its unfinished requests: the next call runs only its own, with the greedy outputs."""
    prompts = h.varied_prompts(3, 20, 40, seed=11)
    want = h.greedy_reference(prompts, 12)
    llm = h.llm("eagle3", 3, spec_extra=CASES[0][2], seed=1)
    eng = llm.engine
    real, calls = eng.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise exc("stop")
        return real()

    monkeypatch.setattr(eng, "step", failing)
    sp = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with pytest.raises(exc, match="stop"):
        llm.generate(prompts, sp)
    assert not eng.has_unfinished_requests() and eng.num_free_pages == eng.num_pages
    assert [o.token_ids for o in llm.generate(prompts[:2], sp)] == want[:2]


def test_the_server_loop_fails_a_failed_steps_request_and_serves_the_next(monkeypatch):
    """The server's engine loop (jspec/serve/engine_loop.py) after a step that failed on the
    device: the request in flight gets the error, and the requests sent after it get the
    greedy outputs (before the engine restored its buffers, every later step failed)."""
    import asyncio

    import jax

    from jspec.serve.engine_loop import EngineLoop

    prompts = h.varied_prompts(3, 20, 40, seed=11)
    want = h.greedy_reference(prompts, 12)
    eng = h.llm("eagle3", 3, spec_extra=CASES[0][2], seed=1).engine
    real, fail = eng.runner._invoke, [True]

    def failing(*a, **k):  # the first call donates its buffers, then fails
        out = real(*a, **k)
        if fail and fail.pop():
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return out

    monkeypatch.setattr(eng.runner, "_invoke", failing)
    sp = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        loop = EngineLoop(eng, idle_wait=0.01)
        loop.start()

        async def run(rid, prompt):
            stream = await loop.add_request(rid, prompt, sp, len(prompt))
            while not (out := await stream.get()).finished:
                pass
            return out

        try:
            first = await run("first", prompts[0])
            return first, await asyncio.gather(*(run(f"r{i}", p) for i, p in enumerate(prompts)))
        finally:
            loop.stop()

    first, rest = asyncio.run(main())
    assert first.error and "RESOURCE_EXHAUSTED" in first.error
    assert [o.error for o in rest] == [None] * 3 and [o.token_ids for o in rest] == want


@pytest.mark.parametrize("name,k", [("eagle3", 3), ("peagle", 3), ("dflash4", 3)])
def test_spec_step_updates_the_caches_in_place(name, k):
    """The compiled step writes both caches where they lie: no temporary as large as one
    layer's K or V buffer. (A one-row drafter write was rewritten by XLA into a select over
    the whole buffer, two cache copies per layer: the server with an EAGLE3 drafter ran out
    of memory on the H200 with the page pool sized to fill the device.) Every shape: the
    verification steps and the general ones (mixed steps among them)."""
    llm = h.llm(name, k, num_pages=1024, attn_impl="reference", linear_impl="reference", sample_impl="reference",
                max_num_partial_prefills=1)
    r = llm.engine.runner
    layer_buffer = r.dkv.k[0].nbytes  # 1024 pages x 16 x 2 heads x 16 x 4 bytes = 2 MiB
    for sh in r.warmup_shapes(1, True):
        if sh.filtering == "on":  # the sampler's sort: nothing of the caches
            continue
        temp = lower_shape(r, sh).compile().memory_analysis().temp_size_in_bytes
        assert temp < layer_buffer // 4, (sh, temp, layer_buffer)
