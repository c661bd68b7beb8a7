"""The lines of the GPU check (scripts/gpu_check.py writes them to docs/gpu_check.md): what
CI, on the CPU, cannot see. Each test is marked ``gpu(group=..., line=...)``: ``line`` is its
name in the report, ``group`` the worker process gpu_check runs it in (the lines of a group
share engines: tests/helpers/spec_e2e.py caches them per process; the groups run side by
side, ``ALONE`` first with the device to itself). The report lists the lines in this
file's order. Each records its figures with ``record_property("detail", ...)``.

Skipped unless pytest is given ``--gpu-ckpts DIR`` (tests/conftest.py). On a CPU the lines
that need a GPU skip; the others run as a smoke test (jnp references, interpreted kernels,
the GPU-kernel assertions left out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers.gpu_lines import DRAFTERS, FALLBACK_TOKENS, MOE_TOKENS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 16
NEAR_TIE_ULPS = 4  # bfloat16 lines: a divergence passes only where float32 puts the two tokens this close
# The group that runs first and alone: its lines size page pools from the device's free memory.
ALONE = "pool"
# The worker group of each drafter's lines.
GROUPS = {"eagle3": "eagle3", "eagle3_full": "eagle3_more", "eagle3_orig": "eagle3_more", "peagle": "peagle",
          "dflash4": "dflash", "dflash8_zlab": "dflash", "draft_llama": "draft_model", "ngram": "peagle"}


def line(group: str, name: str):
    """The marker of a GPU check line: its worker group and its name in the report."""
    return pytest.mark.gpu(group=group, line=name)


def _on_gpu_kernels(eng, on_gpu: bool):
    """On a GPU, the engine picked the GPU kernels ("auto"); a CPU smoke run has none."""
    from jspec.ops import GPU

    plan = eng.runner.plan
    assert not on_gpu or (plan.attn, plan.linear) == (GPU(), GPU()), plan


def _needs_gpu(on_gpu: bool, what: str):
    if not on_gpu:
        pytest.skip(f"needs a GPU: {what}")


def _server_env() -> dict:
    """The server runs as it would alone: XLA's default preallocation, not the check's
    (scripts/gpu_check.py turns it off, marking that the user had not set it), and jspec and
    the tests importable."""
    env = dict(os.environ)
    if env.pop("_GPU_CHECK_PREALLOC_UNSET", None):
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return env


# ---- the server, and the page pool sized from the device's memory ------------------------
@line("serve", "python -m jspec.serve with a drafter answers a completion")
def test_serve(gpu_refs, on_gpu, record_property):
    import httpx

    import jspec
    from tests.helpers import spec_e2e as h

    name, k = "eagle3", 3
    folder, _ = h.target()
    port = 8765
    spec = json.dumps({"method": h.METHOD[name], "model": h.drafter(name), "num_speculative_tokens": k})
    # 0.75 of the device, JAX's default pool: vLLM's 0.9 would leave the side-by-side workers ~8 GB
    cmd = [sys.executable, "-m", "jspec.serve", "--model", folder, "--port", str(port), "--max-num-seqs", "2",
           "--max-model-len", "56", "--page-size", "16", "--warmup", "on", "--speculative-config", spec,
           "--gpu-memory-utilization", "0.75"]
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_check_serve.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_server_env())
    try:
        url = f"http://127.0.0.1:{port}"
        # A CPU (the smoke run) compiles the server's 14 step shapes in ~6 minutes.
        limit = 300 if on_gpu else 1200
        deadline = time.monotonic() + limit
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} (log: gpu_check_serve.log)")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {limit} s")
            time.sleep(1)
        prompt = h.varied_prompts(1, 20, 20, seed=5)[0]
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": folder, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        got = r.json()["choices"][0]["token_ids"]
        sp = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = h.llm(None, enable_prefix_caching=False).generate([prompt], sp)[0].token_ids
        assert got == want, f"{got} vs {want}"
        warm = [ln.strip() for ln in open(log.name) if "warmup:" in ln]
        assert warm, "the server did not warm up"
        record_property("detail", f"warmed up ({warm[-1].split('warmup:')[-1].strip()}), one completion == plain greedy")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


MEMORY_CHILD = """
import json, logging, jax, jspec
retries = []
handler = logging.Handler()
handler.emit = lambda rec: retries.append(1) if "did not fit" in rec.getMessage() else None
logging.getLogger("jspec.engine").addHandler(handler)
llm = jspec.LLM(warmup=False, dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.5)
s, kv = jax.devices()[0].memory_stats(), llm.engine.runner.kv
print("@@" + json.dumps({"limit": s["bytes_limit"], "in_use": s["bytes_in_use"], "retries": len(retries),
                         "kv": sum(a.nbytes for a in kv.k + kv.v), "pages": llm.engine.num_pages}))
"""


@line(ALONE, "gpu_memory_utilization=0.5 in a fresh process: JAX's pool and the KV cache are that share of the device")
def test_memory_share(on_gpu, record_property):
    """vLLM's gpu_memory_utilization is a share of the whole device: in a fresh process the
    first engine sets JAX's pool to it, and its KV cache takes what the share leaves after
    the weights and 10% for XLA's temporaries (jspec/engine/kv_memory.py). Run before this
    process allocates anything (its group runs alone and first), so the child preallocates
    its pool as a user's process would (with XLA_PYTHON_CLIENT_PREALLOCATE=false the pool
    grows in pieces, and the KV arrays found no free block until 3 tries of 5% fewer pages)."""
    _needs_gpu(on_gpu, "JAX's pool is a share of the device's memory")
    import jax

    from jspec import envs

    total = jax.devices()[0].memory_stats()["bytes_limit"] / envs.XLA_PYTHON_CLIENT_MEM_FRACTION
    env = _server_env()
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD], env=env, capture_output=True, text=True, timeout=300)
    got = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    assert out.returncode == 0 and got, f"child exited with {out.returncode}: {out.stderr[-800:]}"
    r = json.loads(got[0][2:])
    pool, used = r["limit"] / total, r["in_use"] / total
    assert abs(pool - 0.5) < 0.01, f"JAX's pool is {pool:.3f} of the device, not 0.5"
    assert 0.43 < used <= 0.455 and r["retries"] == 0, \
        f"weights + KV cache hold {used:.3f} of the device, not ~0.45 ({r['retries']} smaller tries)"
    record_property("detail", f"pool {pool:.3f} of the {total / 2**30:.1f} GiB device; weights + KV cache {used:.3f} "
                              f"({r['pages']} pages, {r['kv'] / 2**30:.1f} GiB of KV, at the first try)")


@line(ALONE, "the page pool sized from memory is allocated and runs: the family, float32")
def test_pool_from_memory(on_gpu, record_property):
    """The page pool sized from memory (default gpu_memory_utilization) is allocated and the
    engine runs: the embedded family (16 K/V arrays of ~6 GB on an H200) in float32. Its last
    array once found no free block in XLA's allocator and the first step ran out of memory
    (jspec/engine/kv_memory.py create_pools, which now tries again with fewer pages)."""
    _needs_gpu(on_gpu, "the page pool is sized from the device's free memory")
    import logging

    import jspec

    retries = []
    handler = logging.Handler()
    handler.emit = lambda rec: retries.append(rec.getMessage()) if "did not fit" in rec.getMessage() else None
    logging.getLogger("jspec.engine").addHandler(handler)
    try:
        llm = jspec.LLM(warmup=False, dtype="float32", max_num_seqs=8, max_model_len=256)
    finally:
        logging.getLogger("jspec.engine").removeHandler(handler)
    eng = llm.engine
    r = eng.runner
    _on_gpu_kernels(eng, on_gpu)
    outs = llm.generate([f"def f{i}(x):" for i in range(8)], jspec.SamplingParams(temperature=0, max_tokens=32))
    assert all(o.outputs[0].token_ids for o in outs)
    arrays = len(r.kv.k) + len(r.kv.v)
    record_property("detail", f"{eng.num_pages} pages ({arrays} arrays of {r.kv.k[0].nbytes / 2**30:.2f} GiB) after "
                              f"{len(retries)} smaller tries; 8 of 8 requests generated")


# ---- speculative greedy == plain greedy --------------------------------------------------
LOSSLESS = [pytest.param(name, k, dtype, id=f"{name}-{dtype}",
                         marks=line(GROUPS[name], f"spec greedy == plain greedy: {what}, K={k}, {dtype}"))
            for name, k, what in DRAFTERS for dtype in ("float32", "bfloat16")]
LOSSLESS += [pytest.param("ngram", 3, dtype, id=f"ngram-{dtype}",  # no checkpoint: drafts come from the sequence
                          marks=line("peagle", f"spec greedy == plain greedy: n-gram (prompt lookup 1..3), K=3, {dtype}"))
             for dtype in ("float32", "bfloat16")]


@pytest.mark.parametrize("name,k,dtype", LOSSLESS)
def test_lossless(name, k, dtype, gpu_refs, on_gpu, record_property):
    """Speculative greedy == plain greedy with prefix caching on and a page pool small enough
    to preempt. float32: every token equal; bfloat16: equal, or parted only at a near-tie."""
    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(8, 1, 50, seed=0)
    # Prompts sharing a 40-token prefix with the longest one: prefix-cache hits.
    longest = max(prompts, key=len)
    prompts += [longest[:40] + [9 + i] for i in range(3)]
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # The reference: plain greedy decoding under the same engine settings (prefix caching
    # on, the same page pool).
    want = [o.token_ids for o in h.llm(None, dtype=dtype).generate(prompts, sp)]
    llm = h.llm(name, k, dtype=dtype)
    eng = llm.engine
    _on_gpu_kernels(eng, on_gpu)
    before = eng.stats()
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    d = h.stats_delta(before, eng.stats())
    after = eng.stats()
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    ties = []
    for i in bad:
        text, gap, top = _divergence(prompts[i], got[i], want[i], dtype)
        # bfloat16: two schedules of the same maths (batch rows, chunking, kernels) round
        # differently, so a token whose float32 lead is within NEAR_TIE_ULPS bf16 steps of
        # the top logit may flip; anything wider is a verification bug.
        assert dtype == "bfloat16" and abs(gap) <= NEAR_TIE_ULPS * 2.0 ** (np.floor(np.log2(top)) - 7), \
            f"prompt {i} differs: {text}"
        ties.append(f"prompt {i} parts at a near-tie: {text}")
    pre = after["num_preemptions"] - before["num_preemptions"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert pre > 0 and hits > 0, f"preemptions {pre}, prefix hits {hits}"
    assert d["mean_acceptance_length"] > 1.3, d
    record_property("detail", f"mean acceptance length {d['mean_acceptance_length']:.2f}, preemptions {pre}, "
                              f"prefix-cache hits {hits}; {len(prompts) - len(bad)} of {len(prompts)} outputs equal"
                              + "".join(f"; {t}" for t in ties))


def _divergence(prompt, got, want, dtype):
    """Where a speculative output leaves the plain one, and the target's logit gap between
    the two tokens there, from one single-sequence forward in ``dtype`` and in float32 (a
    gap at the dtype's rounding level is a near-tie, not a verification bug). Returns
    (text, the float32 gap, the float32 top logit)."""
    import jax.numpy as jnp

    from jspec.kv_cache import AttentionMetadata, KVCache
    from jspec.models.transformer import Transformer
    from tests.helpers import spec_e2e as h

    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = prompt + want[:j]
    gaps = []
    for dt in dict.fromkeys((dtype, "float32")):
        r = h.llm(None, dtype=dt).engine.runner
        c = r.cfg
        n = -(-len(ids) // 16)
        kv = KVCache.create(c.num_layers, n, 16, c.num_kv_heads, c.head_dim, r.kv.k[0].dtype)
        meta = AttentionMetadata.for_single_sequence(list(range(n)), 16, 0, len(ids), n)
        hid, _, _ = r.model.apply({"params": r.params}, jnp.asarray([ids], jnp.int32), meta, kv)
        lg = np.asarray(r.model.apply({"params": r.params}, hid[:, -1], method=Transformer.logits)[0], np.float64)
        gap, top = lg[want[j]] - lg[got[j]], lg.max()
        gaps.append(f"{dt} logit[{want[j]}] - logit[{got[j]}] = {gap:+.4f} (top logit {top:.3f})")
    return f"first at output {j}: spec {got[j]} vs plain {want[j]}; " + "; ".join(gaps), gap, top


# ---- SamplingParams' processors, structured outputs ----------------------------------------
@pytest.mark.parametrize("name,k", [
    pytest.param(n, k, id=n, marks=line(GROUPS[n], f"penalties, logit_bias, logprobs: spec greedy == plain greedy: "
                                                   f"{n}, K={k}, float32"))
    for n, k in (("eagle3", 3), ("dflash4", 3))])
def test_processors(name, k, gpu_refs, on_gpu, record_property):
    """Penalties, logit_bias and logprobs (issue 26) on the GPU kernels: speculative greedy ==
    plain greedy token for token, and the emitted tokens' logprobs equal (float32)."""
    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(6, 4, 40, seed=3)
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.05,
                              frequency_penalty=0.02, repetition_penalty=1.02, logit_bias={5: 1.5, 9: -2.0},
                              logprobs=2)
    want = h.llm(None, dtype="float32").generate(prompts, sp)
    llm = h.llm(name, k, dtype="float32")
    _on_gpu_kernels(llm.engine, on_gpu)
    before = llm.engine.stats()
    got = llm.generate(prompts, sp)
    d = h.stats_delta(before, llm.engine.stats())
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g.token_ids != w.token_ids]
    assert not bad, f"prompts {bad} differ"
    err = max(abs(gl[t].logprob - wl[t].logprob) for g, w in zip(got, want)
              for t, gl, wl in zip(g.token_ids, g.outputs[0].logprobs, w.outputs[0].logprobs))
    # float32 dots on the GPU run in TF32 by default (XLA's GEMMs for the K + 1 verification
    # rows, Triton's tl.dot in the one-row kernels): a 10-bit mantissa, so the two paths'
    # logits part by ~1e-3 (2.0e-3 seen on the H200, 82abd62); the CPU tests hold 1e-4.
    assert err < 1e-2, f"logprobs differ by up to {err}"
    assert d["mean_acceptance_length"] > 1.2, d
    record_property("detail", f"mean acceptance length {d['mean_acceptance_length']:.2f}; {len(prompts)} of "
                              f"{len(prompts)} outputs equal; emitted logprobs within {err:.1e}")


@pytest.mark.parametrize("method", [
    pytest.param(m, id=m, marks=line(f"structured_{m}", "structured outputs (16 JSON schemas): spec greedy == plain "
                                                        f"greedy, all valid: family {m}, float32"))
    for m in ("eagle3", "dflash")])
def test_structured(method, on_gpu, record_property):
    """Structured outputs (issue 27) on the GPU kernels, the shipped family (its real tokenizer
    and drafters), float32: 16 JSON schemas, speculative greedy == plain greedy, every output
    valid."""
    import jspec
    from tests.helpers.structured import schemas, valid

    sch = schemas(16)
    prompts = [f"# config {i}\nsettings = " for i in range(len(sch))]
    sp = [jspec.SamplingParams(temperature=0, max_tokens=120, structured_outputs=jspec.StructuredOutputsParams(
        json=s, disable_any_whitespace=True)) for s in sch]
    # A fixed page pool (the pool line checks one sized from memory): this line runs beside others.
    kw = dict(dtype="float32", max_num_seqs=8, max_model_len=256, num_pages=512)
    want = [o.outputs[0].text for o in jspec.LLM(warmup=False, **kw).generate(prompts, sp)]
    llm = jspec.LLM(speculative_config={"method": method}, warmup=False, **kw)
    _on_gpu_kernels(llm.engine, on_gpu)
    outs = llm.generate(prompts, sp)
    got = [o.outputs[0].text for o in outs]
    bad = [i for i, (o, s) in enumerate(zip(outs, sch)) if o.outputs[0].finish_reason != "stop" or not valid(got[i], s)]
    assert not bad, f"outputs {bad} unfinished or invalid: {[got[i] for i in bad[:2]]}"
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not differ, f"outputs {differ} differ from plain: {got[differ[0]]!r} vs {want[differ[0]]!r}"
    record_property("detail", f"mean acceptance length {llm.engine.stats()['mean_acceptance_length']:.2f}; "
                              f"{len(sch)} of {len(sch)} outputs valid and equal")


# ---- mixed steps, a failed step ------------------------------------------------------------
@pytest.mark.parametrize("name,k", [
    pytest.param(n, k, id=n or "plain", marks=line(g, f"mixed steps: greedy == unmixed plain greedy: {n or 'plain'}, "
                                                      "float32"))
    for n, k, g in ((None, None, "eagle3_more"), ("eagle3", 3, "eagle3"), ("dflash8_zlab", 7, "dflash"),
                    ("ngram", 3, "peagle"), ("draft_llama", 3, "draft_model"))])
def test_mixed(name, k, gpu_refs, on_gpu, record_property):
    """Mixed steps (issue 28: every decode row and a prefill chunk in one call) on the GPU
    kernels, plain or speculative: greedy == the unmixed plain engine's."""
    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(8, 1, 50, seed=5)
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in h.llm(None, dtype="float32").generate(prompts, sp)]
    llm = h.llm(name, k, dtype="float32", max_num_partial_prefills=1)
    eng = llm.engine
    _on_gpu_kernels(eng, on_gpu)
    before = eng.stats()
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    after = eng.stats()
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"outputs {bad} differ"
    n = after["num_mixed_steps"] - before["num_mixed_steps"]
    assert n > 0, "no mixed step ran"
    record_property("detail", f"{n} mixed steps, {after['num_preemptions'] - before['num_preemptions']} preemptions; "
                              "8 of 8 outputs equal")


@line("eagle3", "a step that fails on the device after its call: the engine serves on: eagle3, K=3, float32")
def test_failed_step(gpu_refs, on_gpu, record_property):
    """A step whose call took the donated buffers and then failed (as on the device's out of
    memory): the engine restores zeroed buffers (jspec/engine/recovery.py), preempts its
    running requests and finishes them with the plain greedy outputs, on the GPU kernels."""
    import jax

    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(8, 1, 50, seed=0)
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in h.llm(None, dtype="float32").generate(prompts, sp)]
    eng = h.llm("eagle3", 3, dtype="float32").engine  # the lossless line's engine: compiled
    _on_gpu_kernels(eng, on_gpu)
    r = eng.runner
    real, calls = r._invoke, []

    def failing(*a, **kw):
        out = real(*a, **kw)
        calls.append(1)
        if len(calls) == 5:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: (gpu_check) a failure after the call")
        return out

    r._invoke = failing
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"failed_step{i}", p, sp)
        done, failures = {}, []
        while eng.has_unfinished_requests():
            n0 = eng.scheduler.num_preemptions
            try:
                done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
            except jax.errors.JaxRuntimeError:
                failures.append(eng.scheduler.num_preemptions - n0)
    finally:
        del r._invoke  # the class's method again
    assert len(failures) == 1 and failures[0] > 0, failures
    got = [done[f"failed_step{i}"] for i in range(len(prompts))]
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(prompts), f"{same} of {len(prompts)} outputs equal"
    record_property("detail", f"step 5 failed after its call; {failures[0]} requests preempted, {same} of {same} "
                              "outputs == plain greedy")


# ---- targets the GPU kernels cannot take, or take through other kernels --------------------
@line("peagle", "head_dim 24 runs on the XLA path == transformers")
def test_fallback(gpu_ckpts, gpu_refs, on_gpu, record_property):
    import jspec

    r = gpu_refs["qwen3_hd24"]
    # A fixed small page pool: sized from free memory it would keep most of the device
    # (until collected) from the server the serve line starts.
    llm = jspec.LLM(os.path.join(gpu_ckpts, "qwen3_hd24"), warmup=False, max_num_seqs=1, max_model_len=64,
                    page_size=8, num_pages=32)
    _on_gpu_kernels(llm.engine, on_gpu)
    out = llm.generate([r["prompt"]], jspec.SamplingParams(temperature=0, max_tokens=FALLBACK_TOKENS,
                                                           ignore_eos=True))[0].token_ids
    assert out == r["greedy"], f"{out} vs transformers {r['greedy']}"
    record_property("detail", f"{FALLBACK_TOKENS} greedy tokens == transformers (float32)")


@pytest.mark.parametrize("method", [
    pytest.param(None, id="plain", marks=line("draft_model", "a Qwen3 mixture-of-experts target == transformers: "
                                                             "plain, float32")),
    pytest.param("ngram", id="ngram", marks=line("draft_model", "a Qwen3 mixture-of-experts target == transformers: "
                                                                "n-gram K=3, float32"))])
def test_moe_target(method, gpu_ckpts, gpu_refs, on_gpu, record_property):
    """The Qwen3-MoE target's greedy output on the GPU == transformers' (float32), plain or
    speculating (``method`` "ngram": the K+1-row verification through the experts too)."""
    import jspec
    from tests.helpers import spec_e2e as h

    r = gpu_refs["qwen3_moe"]
    spec = None if method is None else h.spec_config(method, 3)
    llm = jspec.LLM(os.path.join(gpu_ckpts, "qwen3_moe"), warmup=False, max_num_seqs=2, max_model_len=64,
                    page_size=8, num_pages=32, speculative_config=spec)
    _on_gpu_kernels(llm.engine, on_gpu)
    record_property("detail", _greedy_equals_references(llm, r, MOE_TOKENS, "transformers (float32)"))


def _greedy_equals_references(llm, r, n: int, what: str) -> str:
    """Generate ``n`` greedy tokens for each of ``r["prompts"]``, assert them equal to
    ``r["greedy"]`` (transformers'), and return the line's detail."""
    import jspec
    from tests.helpers import spec_e2e as h

    before = llm.engine.stats()
    outs = llm.generate(r["prompts"], jspec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for o, want in zip(outs, r["greedy"]):
        assert o.token_ids == want, f"{o.token_ids} vs transformers {want}"
    d = h.stats_delta(before, llm.engine.stats())
    extra = "" if llm.engine.K == 0 else f"; mean acceptance length {d['mean_acceptance_length']:.2f}"
    return f"{len(outs)} x {n} greedy tokens == {what}{extra}"


@pytest.mark.parametrize("name,method", [
    pytest.param("target_fp8", None, id="channel-plain", marks=line(
        "eagle3", "an FP8 target == transformers on its dequantized weights: compressed-tensors per channel, "
                  "plain, float32")),
    pytest.param("target_fp8", "eagle3", id="channel-eagle3", marks=line(
        "eagle3", "an FP8 target == transformers on its dequantized weights: compressed-tensors per channel, "
                  "EAGLE3 K=3, float32")),
    pytest.param("target_fp8_block", "eagle3", id="block-eagle3", marks=line(
        "eagle3", "an FP8 target == transformers on its dequantized weights: fp8 16 x 16 blocks, EAGLE3 K=3, "
                  "float32"))])
def test_fp8_target(name, method, gpu_ckpts, gpu_refs, on_gpu, record_property):
    """An FP8 checkpoint's greedy output on the GPU == transformers' on its dequantized weights
    (float32), plain or with an (unquantized) EAGLE3 drafter, beside the GPU attention kernels:
    per channel, the scale after the dot (two rows a step here: XLA's dots; one row takes the
    kernels, the "one-row kernels on FP8 weights" line); per block (jspec/ops.py,
    _fp8_block_linear) the row blocks' dots up to FP8_BLOCK_DOT_ROWS rows, decode and
    verification here, and the weight dequantized first for the prompts."""
    import jspec
    from jspec.quantization import QuantWeight
    from tests.helpers import spec_e2e as h
    from tests.helpers.gpu_lines import FP8_TOKENS

    r = gpu_refs[name]
    spec = None if method is None else h.spec_config(method, 3)
    llm = jspec.LLM(os.path.join(gpu_ckpts, name), warmup=False, max_num_seqs=2, max_model_len=64,
                    page_size=8, num_pages=32, speculative_config=spec)
    _on_gpu_kernels(llm.engine, on_gpu)
    assert isinstance(llm.engine.runner.params["layers_0"]["attn"]["qkv_proj"]["weight"], QuantWeight)
    record_property("detail", _greedy_equals_references(llm, r, FP8_TOKENS,
                                                        "transformers on the dequantized weights (float32)"))


@pytest.mark.parametrize("name,method", [
    pytest.param("target", None, id="plain", marks=line(
        "eagle3", "a gpt-oss target == transformers: sinks, window 8, YaRN, experts with biases, plain, float32")),
    pytest.param("target", "eagle3", id="eagle3", marks=line(
        "eagle3", "a gpt-oss target == transformers: EAGLE3 K=3, float32")),
    pytest.param("mxfp4", None, id="mxfp4", marks=line(
        "eagle3", "a gpt-oss target with MXFP4 experts (packed; decode through the MXFP4 kernel) == transformers "
                  "on their dequantized values, float32"))])
def test_gpt_oss_target(name, method, gpu_ckpts, gpu_refs, on_gpu, record_property, monkeypatch):
    """gpt-oss's greedy output on the GPU == transformers': decode rows through the paged-attention
    kernel, prompts through the ragged one, both with sinks and the sliding layers' window, the
    experts through ops.moe's XLA ways, or packed MXFP4 ones at decode through
    kernels_pallas/moe_experts_mxfp4.py (its calls counted)."""
    import jspec
    import kernels_pallas.moe_experts_mxfp4 as mx
    from tests.helpers.gpu_lines import GPT_OSS_TOKENS

    traced = []
    real = mx.moe_experts_mxfp4_gpu
    monkeypatch.setattr(mx, "moe_experts_mxfp4_gpu", lambda *a, **kw: traced.append(1) or real(*a, **kw))

    root = os.path.join(gpu_ckpts, "gpt_oss")
    spec = None if method is None else {"method": "eagle3", "model": os.path.join(root, "eagle3"),
                                        "num_speculative_tokens": 3}
    llm = jspec.LLM(os.path.join(root, name), warmup=False, max_num_seqs=2, max_model_len=64, page_size=8,
                    num_pages=32, speculative_config=spec, dtype="float32")
    _on_gpu_kernels(llm.engine, on_gpu)
    record_property("detail", _greedy_equals_references(llm, gpu_refs[f"gpt_oss/{name}"], GPT_OSS_TOKENS,
                                                        "transformers (float32)"))
    if name == "mxfp4" and on_gpu:
        assert traced, "the MXFP4 expert kernel never ran"


# ---- the rejection kernel ---------------------------------------------------------------
@pytest.mark.parametrize("method,with_probs", [
    pytest.param(m, p, id=i, marks=line("peagle", f"rejection kernel == reference: {what}"))
    for m, p, i, what in (("standard", False, "standard", "greedy + sampled rows, no draft probs"),
                          ("standard", True, "standard-probs", "probabilistic, with draft probs"),
                          ("synthetic", False, "synthetic", "synthetic acceptance"))])
def test_rejection(method, with_probs, on_gpu, record_property):
    """The GPU rejection-sampling kernel == its jnp reference on seeded inputs, at a Llama-3
    vocabulary (a CPU smoke run: the kernel interpreted, a smaller vocabulary)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.rejection_sampling import gpu_kernels, ref_rejection_sample, rejection_sample

    B, K, V = (16, 7, 128256) if on_gpu else (16, 7, 3000)
    rng = np.random.default_rng(11)
    key = jax.random.PRNGKey(5)
    logits = 3.0 * jax.random.normal(key, (B, K + 1, V), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    # Half the drafts are the target's argmax, so greedy rows accept some and reject some.
    top = jnp.argmax(logits[:, :K], -1).astype(jnp.int32)
    drafts = jnp.where(jnp.asarray(rng.random((B, K)) < 0.7), top, drafts)
    nd = jnp.asarray(rng.integers(0, K + 1, B), jnp.int32)
    temp = jnp.asarray(np.where(np.arange(B) % 2, rng.uniform(0.5, 1.5, B), 0.0), jnp.float32)
    top_k = jnp.asarray(np.where(np.arange(B) % 4 == 1, 50, 0), jnp.int32)
    top_p = jnp.asarray(np.where(np.arange(B) % 4 == 3, 0.9, 1.0), jnp.float32)
    q = None
    if with_probs:
        q = jax.nn.softmax(logits[:, :K] + jax.random.normal(jax.random.PRNGKey(6), (B, K, V)), -1)
    seeds = jnp.asarray(rng.integers(0, 2**31, B), jnp.int32)
    pos = jnp.asarray(rng.integers(0, 4000, B), jnp.int32)
    args = (logits, drafts, nd, q, temp, top_k, top_p, seeds, pos)
    kw = dict(method=method, synthetic_rates=(0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3) if method == "synthetic" else None)
    want = ref_rejection_sample(*args, **kw)
    kernels = gpu_kernels(interpret=not on_gpu)
    got = jax.jit(lambda *a: rejection_sample(*a, kernels=kernels, **kw))(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    n = np.asarray(want[1])
    assert len(set(n.tolist())) > 2, n  # several acceptance lengths: not a vacuous batch
    record_property("detail", f"B={B} K={K} V={V}: tokens and counts equal; counts {sorted(set(n.tolist()))}")


def max_rel_err(got, want) -> float:
    """The largest error over the largest value, in f32 (the kernel lines' measure)."""
    import jax.numpy as jnp

    g32, w32 = (jnp.asarray(a).astype(jnp.float32) for a in (got, want))
    return float(jnp.max(jnp.abs(g32 - w32)) / jnp.max(jnp.abs(w32)))


# ---- the MXFP4 expert kernels' two paths -----------------------------------------------------
@line("peagle", "MXFP4 expert kernels at gpt-oss-20b's widths, bf16: the CUDA-core path (4 pairs; each pair "
                "apart and summed per token) and the tensor-core one (PTX decode, 16 pairs); the router's "
                "norm + logits kernel == reference")
def test_mxfp4_kernel_paths(on_gpu, record_property):
    """kernels_pallas/moe_experts_mxfp4.py at one token (4 pairs: the CUDA-core stream, its
    PTX decode and products; each pair's rows apart and, the pairs' weights and a residual
    given, down summing each token's pairs) and four (16 pairs: the float16 tensor-core stream,
    its PTX decode), == the jnp reference, bf16 activations, gpt-oss's biases and clamped
    SwiGLU; moe_router.norm_logits (the router's input norm and projection) at gpt-oss-20b's
    router == its reference (a CPU smoke run: interpreted, narrow experts, the tensor-core
    path forced)."""
    import jax.numpy as jnp

    from kernels_pallas import moe_experts_mxfp4 as mx
    from kernels_pallas.moe_router import norm_logits, ref_norm_logits
    from tests.helpers.mxfp4 import packed

    E, I, H = (32, 2880, 2880) if on_gpu else (4, 64, 96)
    rng = np.random.default_rng(9)

    gu, dn = packed(rng, E, 2 * I, H), packed(rng, E, H, I)
    bf = jnp.bfloat16
    b_gu, b_dn = (jnp.asarray(0.1 * rng.normal(size=s), bf) for s in ((E, 2 * I), (E, H)))
    errs = {}
    for N, mma in ((1, False), (4, True)):
        x = jnp.asarray(rng.normal(size=(N, H)), bf)
        experts = jnp.asarray(rng.integers(0, E, N * 4), jnp.int32)
        if on_gpu:
            assert mx.use_mma(N * 4, I, H, bf) == mma
        path = "tensor cores" if mma else "CUDA cores"
        combined = dict(weights=jnp.asarray(rng.random((N, 4)), jnp.float32),
                        residual=jnp.asarray(rng.normal(size=(N, H)), bf))
        for label, combine in ((path, {}),) + (() if mma else ((path + ", summed", combined),)):
            want = mx.ref_moe_experts_mxfp4(x, experts, *gu, *dn, top_k=4, b_gate_up=b_gu, b_down=b_dn, limit=7.0,
                                            **combine)
            got = mx.moe_experts_mxfp4_gpu(x, experts, *gu, *dn, b_gu, b_dn, top_k=4, limit=7.0, mma=mma,
                                           interpret=not on_gpu, **combine)
            errs[label] = max_rel_err(got, want)
    assert all(e < 2e-2 for e in errs.values()), errs
    x = jnp.asarray(3 * rng.normal(size=(1, H)), bf)
    w_router, nw, b_router = (jnp.asarray(a, bf) for a in (0.05 * rng.normal(size=(E, H)),
                                                          1 + 0.1 * rng.normal(size=H), 0.1 * rng.normal(size=E)))
    got = norm_logits(x, w_router, norm_w=nw, eps=1e-5, bias=b_router, interpret=not on_gpu)
    want = ref_norm_logits(x, w_router, norm_w=nw, eps=1e-5, bias=b_router)
    assert np.array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    errs["router logits"] = max_rel_err(got[1], want[1])
    assert errs["router logits"] < 2**-6, errs  # a bf16 rounding apart at most (the f32 sums' order)
    record_property("detail", f"E={E} I={I} H={H}, bf16: largest relative error "
                              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


# ---- the one-row kernels over a K no long chunk divides ---------------------------------------
@line("peagle", "projection kernels over gpt-oss's K = 2880 (the last chunk masked) == reference")
def test_masked_k_chunk(on_gpu, record_property):
    """fused_linear (RMSNorm, SwiGLU prologues), qkv_rope_kv_write and fused_linear_rows (4
    rows) over K = 2880, whose last chunk is masked (kernels_pallas/fused_linear.py k_block),
    == their jnp references in bf16 (a CPU smoke run: interpreted, K = 320 in chunks of 128)."""
    import jax
    import jax.numpy as jnp

    from jspec.config import RopeConfig
    from jspec.models.layers import rope_inv_freq
    from kernels_pallas.fused_linear import fused_linear_gpu, k_block, ref_fused_linear
    from kernels_pallas.fused_linear_rows import default_blocks as rows_blocks
    from kernels_pallas.fused_linear_rows import fused_linear_rows
    from kernels_pallas.qkv_rope_kv_write import kernel_blocks, qkv_rope_kv_write_gpu, ref_qkv_rope_kv_write
    from kernels_pallas.rope_kv_write import rope_tables

    K, H, KVH, D = (2880, 64, 8, 64) if on_gpu else (320, 4, 2, 32)
    blocks = None if on_gpu else (16, 128, 4, 4, True)
    if on_gpu:
        assert k_block(K, 512) == 512 and kernel_blocks((H + 2 * KVH) * D, K, D, jnp.bfloat16)[1] == 512
    ks = jax.random.split(jax.random.PRNGKey(3), 8)
    bf = jnp.bfloat16
    x = (2 * jax.random.normal(ks[0], (1, 2 * K))).astype(bf)
    nw = (1 + 0.1 * jax.random.normal(ks[1], (K,))).astype(bf)
    w = (0.05 * jax.random.normal(ks[2], ((H + 2 * KVH) * D, K))).astype(bf)
    errs = {}
    for prologue, xin, kw in (("rmsnorm", x[:, :K], {"norm_w": nw}), ("silu_mul", x, {})):
        got = fused_linear_gpu(xin, w, kw.get("norm_w"), prologue=prologue, eps=1e-5, blocks=blocks,
                               interpret=not on_gpu)
        errs[prologue] = max_rel_err(got, ref_fused_linear(xin, w, prologue=prologue, eps=1e-5, **kw))
    P, S = 4, 16
    kp, vp = (jax.random.normal(k, (P, S, KVH, D)).astype(bf) for k in ks[3:5])
    cos, sin = rope_tables(jnp.array([29]), rope_inv_freq(RopeConfig(10000.0), D))
    args = (x[:, :K], w, nw, None, cos, sin, jnp.array([19], jnp.int32), kp, vp)
    want = ref_qkv_rope_kv_write(*args, num_heads=H, eps=1e-5)
    got = qkv_rope_kv_write_gpu(*args, num_heads=H, eps=1e-5, blocks=blocks, interpret=not on_gpu)
    errs["qkv_rope_kv_write"] = max(max_rel_err(g, r) for g, r in zip(got, want))
    xr = (2 * jax.random.normal(ks[5], (4, K))).astype(bf)
    rb = rows_blocks(w.shape[0], K, bf) if on_gpu else (32, 128, 4, 2)
    assert K % rb[1]  # a masked last chunk
    got = fused_linear_rows(xr, w, blocks=None if on_gpu else rb, interpret=not on_gpu)
    errs["fused_linear_rows"] = max_rel_err(got, ref_fused_linear(xr, w))
    assert all(e < 2e-2 for e in errs.values()), errs
    record_property("detail", f"K={K}, bf16: largest relative error {max(errs.values()):.1e} "
                              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


@line("peagle", "one-row kernels on FP8 weights (per-channel scale; elementwise, gate_up's float16 tensor-core "
                "stream) == reference")
def test_fp8_one_row_kernels(on_gpu, record_property):
    """fused_linear (RMSNorm, none + residual, SwiGLU + residual) and qkv_rope_kv_write on
    per-channel FP8 weights at Llama-3.1-8B's widths, their default tiles (the FP8 rows of
    kernels_pallas/tuning.py), == their jnp references, bf16 activations and f32 ones (the
    FP8 checkpoint lines' models; gate_up [2I, K], bare as the RMSNorm hand-over runs it, takes
    the float16 tensor-core stream with bf16 activations; down_proj split over K too,
    fused_linear_split_k); a CPU smoke run: interpreted, narrow weights."""
    import jax
    import jax.numpy as jnp

    from jspec.config import RopeConfig
    from jspec.models.layers import rope_inv_freq
    from jspec.quantization import quantize_fp8
    from kernels_pallas.fused_linear import fused_linear, ref_fused_linear
    from kernels_pallas.qkv_rope_kv_write import qkv_rope_kv_write, ref_qkv_rope_kv_write
    from kernels_pallas.rope_kv_write import rope_tables

    (F, K, I), (H, KVH, D) = ((4096, 4096, 14336), (32, 8, 128)) if on_gpu else ((128, 256, 256), (4, 2, 32))
    ks = jax.random.split(jax.random.PRNGKey(5), 8)

    def fp8(key, shape):
        q = quantize_fp8(0.05 * jax.random.normal(key, shape), None, "bfloat16")
        return q.w, q.scale.reshape(-1)

    wqkv, sqkv = fp8(ks[0], ((H + 2 * KVH) * D, K))
    wo, so = fp8(ks[1], (F, K))
    wd, sd = fp8(ks[2], (F, I))
    wg, sg = fp8(ks[3], (2 * I, K))
    errs = {}
    for dt in (jnp.bfloat16, jnp.float32):
        x = (2 * jax.random.normal(ks[3], (1, 2 * I))).astype(dt)
        nw = (1 + 0.1 * jax.random.normal(ks[4], (K,))).astype(dt)
        res = jax.random.normal(ks[5], (1, F)).astype(dt)
        for name, xin, w, s, kw in (("qkv + rmsnorm", x[:, :K], wqkv, sqkv, {"prologue": "rmsnorm", "norm_w": nw}),
                                    ("o + residual", x[:, :K], wo, so, {"residual": res}),
                                    ("down + swiglu + residual", x, wd, sd, {"prologue": "silu_mul", "residual": res}),
                                    ("gate_up", x[:, :K], wg, sg, {})):
            got = fused_linear(xin, w, w_scale=s, eps=1e-5, interpret=not on_gpu, **kw)
            with jax.default_matmul_precision("highest"):  # XLA's f32 dots on the GPU default to TF32
                want = ref_fused_linear(xin, w, w_scale=s, eps=1e-5, **kw)
            errs[f"{name} {jnp.dtype(dt).name}"] = max_rel_err(got, want)
        P, S = 4, 16
        kp, vp = (jax.random.normal(k, (P, S, KVH, D)).astype(dt) for k in ks[6:8])
        cos, sin = rope_tables(jnp.array([29]), rope_inv_freq(RopeConfig(10000.0), D))
        args = (x[:, :K], wqkv, nw, None, cos, sin, jnp.array([19], jnp.int32), kp, vp)
        with jax.default_matmul_precision("highest"):
            want = ref_qkv_rope_kv_write(*args, num_heads=H, eps=1e-5, w_scale=sqkv)
        got = qkv_rope_kv_write(*args, num_heads=H, eps=1e-5, interpret=not on_gpu, w_scale=sqkv)
        errs[f"qkv_rope_kv_write {jnp.dtype(dt).name}"] = max(max_rel_err(g, r) for g, r in zip(got, want))
    # down_proj split over K (fused_linear_split_k: the device's split at 8B widths), bf16 activations
    from kernels_pallas.fused_linear_split_k import fused_linear_split_k
    x = (2 * jax.random.normal(ks[3], (1, 2 * I))).astype(jnp.bfloat16)
    res = jax.random.normal(ks[5], (1, F)).astype(jnp.bfloat16)
    kw = dict(prologue="silu_mul", residual=res, w_scale=sd, eps=1e-5)
    got = fused_linear_split_k(x, wd, blocks=None if on_gpu else (2, 16, 128, 4, 3, True), interpret=not on_gpu, **kw)
    errs["down split over K bfloat16"] = max_rel_err(got, ref_fused_linear(x, wd, **kw))
    assert all(e < (2e-2 if "bfloat16" in k else 1e-4) for k, e in errs.items()), errs
    record_property("detail", f"largest relative error {max(errs.values()):.1e}: "
                              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


@line("peagle", "W8A8: an FP8 weight's GEMM of many rows on FP8 tensor cores (per-token FP8 activations) == its maths")
def test_fp8_gemm(on_gpu, record_property, monkeypatch):
    """The plan of a checkpoint with FP8 activations (compressed-tensors per channel, dynamic
    per-token input_activations) sets fp8_gemm on this GPU (JSPEC_FP8_GEMM unset); ops.linear of bf16 rows beyond
    FP8_GEMM_MIN_ROWS over an FP8 weight (8B's down_proj width) then runs an FP8 GEMM (its
    compiled program takes the FP8 operands) and == the per-token quantization and the FP8
    product in float64 (numpy), within bf16's rounding of the result; a CPU smoke run: the
    XLA:CPU program, narrow weights, the plan's device check left out."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jspec import ops
    from jspec.config import ModelConfig, RopeConfig
    from jspec.quantization import quant_config_from_hf, quantize_fp8
    from tests.helpers.fp8 import per_token_fp8, quant_config
    from tests.helpers.gpu_lines import fp8_gemms

    M, F, K = (256, 4096, 14336) if on_gpu else (32, 96, 256)
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=F, intermediate_size=K, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(500000.0),
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False, qk_norm=False,
                      max_position_embeddings=4096, quantization=quant_config_from_hf(quant_config("ct_channel")))
    monkeypatch.delenv("JSPEC_FP8_GEMM", raising=False)  # on by default (jspec/envs.py)
    plan = ops.plan_kernels(cfg)
    assert plan.fp8_gemm == on_gpu, plan
    plan = dataclasses.replace(plan, fp8_gemm=True, in_out_weights=False)
    ks = jax.random.split(jax.random.PRNGKey(9), 3)
    x = (2 * jax.random.normal(ks[0], (M, K))).astype(jnp.bfloat16)
    q = quantize_fp8(0.05 * jax.random.normal(ks[1], (F, K)), None, "bfloat16")
    res = jax.random.normal(ks[2], (M, F)).astype(jnp.bfloat16)
    # compiled as the engine's steps of many rows are (KernelPlan.many_rows_options: no Triton GEMMs)
    fn = jax.jit(lambda x, q, r: ops.linear(plan, x, q, residual=r), compiler_options=plan.many_rows_options)
    got = np.asarray(fn(x, q, res).astype(jnp.float32), np.float64)
    hq, xs = per_token_fp8(x.astype(jnp.float32))
    want = np.asarray(res.astype(jnp.float32), np.float64) + (
        hq @ np.asarray(q.w.astype(jnp.float32), np.float64).T) * xs * np.asarray(q.scale, np.float64).reshape(-1)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    f8_gemm = fp8_gemms(fn.lower(x, q, res).compile().as_text())
    assert err < 1e-2 and (f8_gemm or not on_gpu), (err, f8_gemm)
    record_property("detail", f"[{M}, {K}] x [{F}, {K}]: relative error {err:.1e} against float64; the FP8 GEMM: "
                              f"{f8_gemm[0] if f8_gemm else 'none (CPU)'}")

# ---- warmup ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,k", [
    pytest.param("eagle3", 3, id="eagle3", marks=line("eagle3", "LLMEngine.warmup() with a drafter (EAGLE3)")),
    pytest.param("dflash4", 3, id="dflash4", marks=line("dflash", "LLMEngine.warmup() with a drafter (DFlash)"))])
def test_warmup(name, k, gpu_refs, record_property):
    """LLMEngine.warmup() with a drafter compiles every shape bucket; requests compile none."""
    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(4, 1, 40, seed=3)
    sp = jspec.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # The reference first: a plain engine built and run for the first time in this process
    # between the warmup and the requests costs the speculative step one retrace on
    # jax 0.11.2 (seen on the H100; not in a server, which runs one engine).
    want = [o.token_ids for o in h.llm(None, enable_prefix_caching=False).generate(prompts, sp)]
    llm = h.llm(name, k, seed=2)  # a fresh engine
    eng = llm.engine
    shapes = eng.warmup_shapes()
    eng.warmup()
    n = eng.runner.num_compilations
    assert n == len(shapes), (n, len(shapes))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert eng.runner.num_compilations == n, "a request compiled a new shape after warmup"
    record_property("detail", f"{n} shapes compiled, none after; outputs == plain greedy")


@line("peagle", "an FP8 KV cache: the attention kernels over FP8 pages == over bf16 pages of the same values; "
                "the KV writers saturate")
def test_fp8_kv_cache_kernels(on_gpu, record_property):
    """paged and ragged attention (the GPU kernels) over float8_e4m3fn pages == the same kernels
    over bf16 pages holding the same values, bit for bit (each value converted to q's dtype as
    it is read); RoPE + KV write into FP8 pages == into bf16 pages then kv_store (saturated at
    448). A CPU smoke run: the kernels interpreted."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import paged_attention as pa
    from kernels_pallas import ragged_paged_attention as rpa
    from kernels_pallas.rope_kv_write import rope_kv_write, rope_tables
    from tests.kernels.test_paged_attention import MODES, make_batch
    from tests.kernels.test_ragged_paged_attention import MIX, make_step

    bf, f8 = jnp.bfloat16, jnp.float8_e4m3fn
    same = lambda a, b: bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),  # noqa: E731
                                            equal_nan=True))
    checks = {}
    for name, q_len, kv_lens, new, causal in MODES[:2]:
        q, k, v, *meta = make_batch(1, q_len=q_len, kv_lens=kv_lens, kv_heads=2, group=4, dtype=jnp.float32,
                                    causal=causal, new_tokens=new)
        k8, v8 = pa.kv_store(k, f8), pa.kv_store(v, f8)
        got, want = (pa.kernel_gpu(q.astype(bf), kk, vv, *meta, sm_scale=0.1, interpret=not on_gpu)
                     for kk, vv in ((k8, v8), (k8.astype(bf), v8.astype(bf))))
        checks[f"paged {name}"] = same(got, want)
    q, k, v, *meta = make_step(2, MIX, num_tokens=64, max_seqs=10, group=2, dtype=jnp.float32)
    k8, v8 = pa.kv_store(k, f8), pa.kv_store(v, f8)
    fn = lambda *a: rpa.kernel_gpu(q.astype(bf), *a, *meta, sm_scale=0.1, interpret=not on_gpu)  # noqa: E731
    checks["ragged"] = same(fn(k8, v8), fn(k8.astype(bf), v8.astype(bf)))
    H, KVH, D, P, S = 4, 2, 64, 6, 8
    kp = jnp.zeros((P, S, KVH, D), bf)
    qkv = (jax.random.normal(jax.random.PRNGKey(0), (2, (H + 2 * KVH) * D)) * 300).astype(bf)
    cos, sin = rope_tables(jnp.array([29, 30]), 1.0 / (10000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    slots = jnp.array([19, 3], jnp.int32)
    _, k8w, v8w = rope_kv_write(qkv, cos, sin, slots, kp.astype(f8), kp.astype(f8), num_heads=H,
                                interpret=not on_gpu)
    _, kbw, vbw = rope_kv_write(qkv, cos, sin, slots, kp, kp, num_heads=H, interpret=not on_gpu)
    checks["rope_kv_write"] = same(k8w, pa.kv_store(kbw, f8)) and same(v8w, pa.kv_store(vbw, f8))
    checks["saturated"] = float(jnp.max(jnp.abs(v8w.astype(jnp.float32)))) == 448.0
    assert all(checks.values()), checks
    record_property("detail", "bit for bit: " + ", ".join(checks))
