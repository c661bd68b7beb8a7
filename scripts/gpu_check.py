"""The GPU check: what CI (CPU only) cannot see, in one device call.

    # 1. On a CPU machine with the test extra (torch, speculators): build the tiny checkpoints
    #    and the transformers references once (a few MB; carried to the GPU machine).
    python scripts/gpu_check.py --build .gpu_check
    # 2. On the GPU machine (the packages its image lacks as wheels: scripts/device_wheels.sh;
    #    JSPEC_COMMIT names the commit checked where the tree has no .git, or a stale one: the
    #    lent machine's copy kept the session's first commit; the report's code digest, which
    #    `--digest` prints at any checkout, says which code ran):
    JSPEC_COMMIT=<hash> python scripts/gpu_check.py --ckpts .gpu_check --md $OUT/gpu_check.md
    # The lines run in worker processes, their groups side by side (they are mostly
    # compilation, on the host's cores); then the performance table, alone. The report is
    # rewritten after every line. If a call's limit cuts the lines short, carry the report
    # back and go on in a second call with --resume (it keeps the report's passing lines and
    # runs the rest). --no-perf leaves the table out; --perf-only rewrites only the table's
    # section of an existing report: cp docs/gpu_check.md $OUT/ && ... --perf-only

Run it whenever jspec/ or kernels_pallas/ change, and commit its docs/gpu_check.md with
the change (overwritten each run). Each line passes or fails on its own:
  - speculative greedy == plain greedy on the GPU kernels, every drafter method and layout
    (a draft model, and the n-gram method, which has no checkpoint),
    float32 and bfloat16, prefix caching on and a page pool small enough to preempt (the
    tiny target of tests/helpers/spec_e2e.py, whose drafters agree with it through a
    planted feature, so acceptance is well above 1). float32: every token equal. bfloat16:
    every token equal, or outputs part only at a near-tie (the float32 logits of the two
    tokens within NEAR_TIE_ULPS bfloat16 steps of the top logit), each one reported;
  - a head_dim (24) that the GPU kernels cannot take runs on the XLA path and matches
    transformers' greedy output;
  - the GPU rejection-sampling kernel == its jnp reference on seeded inputs (greedy,
    probabilistic with draft probabilities, synthetic), at a Llama-3 vocabulary;
  - LLMEngine.warmup() with a drafter, and ``python -m jspec.serve`` with a drafter
    answering one OpenAI completion with the greedy tokens;
  - a step that fails after its call took the donated caches: the engine restores them and
    finishes its requests with the greedy outputs;
  - a quick performance table (scripts/bench.py's measurements, batch 1, bf16 8B shape).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np

# This process shares the device with the server it starts (the serve line): without this,
# its XLA client would hold 75% of the device and the server would size its KV page pool
# from memory it cannot have.
# Its workers (below) share the device the same way; the marker tells them that the user
# had not set it, so that the server still gets XLA's default.
if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["_GPU_CHECK_PREALLOC_UNSET"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):  # ROOT: jspec and the tests package (tests.helpers)
    if p not in sys.path:
        sys.path.insert(0, p)

# (drafter name in tests/helpers/spec_e2e.py, K, what it covers)
DRAFTERS = [
    ("eagle3", 3, "EAGLE3 speculators, reduced vocabulary (d2t)"),
    ("eagle3_full", 3, "EAGLE3 speculators, full vocabulary"),
    ("eagle3_orig", 7, "EAGLE3 original layout (midlayer.*)"),
    ("peagle", 7, "PEagle speculators"),
    ("dflash4", 3, "DFlash speculators"),
    ("dflash8_zlab", 7, "DFlash z-lab layout"),
    ("draft_llama", 3, "a draft model (2-layer Llama, method draft_model)"),
]
MAX_TOKENS = 16
NEAR_TIE_ULPS = 4  # bfloat16 lines: a divergence passes only where float32 puts the two tokens this close
FALLBACK_PROMPT_LEN, FALLBACK_TOKENS = 12, 12
MOE_TOKENS = 16


def build(folder: str):
    """Tiny checkpoints and the transformers references (CPU; needs torch + speculators)."""
    from tests.helpers import spec_e2e as h
    from tests.helpers.targets import build_hf_model, hf_greedy

    os.makedirs(folder, exist_ok=True)
    h._CACHE["root"] = os.path.abspath(folder)
    h.target()
    for name, _, _ in DRAFTERS:
        h.drafter(name)
    qwen = build_hf_model("qwen3")  # head_dim 24: no GPU kernel takes it
    qwen.save_pretrained(os.path.join(folder, "qwen3_hd24"))
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 384, size=FALLBACK_PROMPT_LEN)]
    refs = {"qwen3_hd24": {"prompt": prompt, "greedy": hf_greedy(qwen, prompt, FALLBACK_TOKENS)}}
    moe = build_hf_model("qwen3_moe")  # a Qwen3 mixture-of-experts target (8 experts, 2 a token)
    moe.save_pretrained(os.path.join(folder, "qwen3_moe"))
    prompts = [[int(t) for t in np.random.default_rng(5 + i).integers(3, 384, size=n)] for i, n in enumerate((7, 30))]
    refs["qwen3_moe"] = {"prompts": prompts, "greedy": [hf_greedy(moe, p, MOE_TOKENS) for p in prompts]}
    with open(os.path.join(folder, "references.json"), "w") as f:
        json.dump(refs, f)
    print(f"built {sorted(os.listdir(folder))} under {folder}")


def use_checkpoints(folder: str):
    """Point tests/helpers/spec_e2e.py at the prebuilt folders (no torch model is rebuilt)."""
    from tests.helpers import spec_e2e as h

    folder = os.path.abspath(folder)
    h._CACHE["root"] = folder
    h._CACHE["target"] = (os.path.join(folder, "target"), None)
    for name, _, _ in DRAFTERS:
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: run `python scripts/gpu_check.py --build {folder}` on a CPU machine first")
        h._CACHE[("drafter", name)] = path
    with open(os.path.join(folder, "references.json")) as f:
        return json.load(f)


class Report:
    """The lines' results in the table's order, whichever worker reports first; the report at
    ``md`` is rewritten after every line, so a run cut short by a time limit keeps what it
    checked."""

    def __init__(self, names: list[str], md: str | None = None):
        self.names = names
        self.results: dict[str, tuple[bool, str]] = {}
        self.md = md
        self.device = "unknown"
        self.jax = "unknown"

    @property
    def lines(self) -> list[tuple[str, bool, str]]:
        return [(n, *self.results[n]) for n in self.names if n in self.results]

    def resume(self, path: str):
        """--resume: keep the passing lines of an earlier run's report at ``path`` (cut short
        by a device call's time limit) and skip them in this run; failed lines run again. Its
        commit must be this run's."""
        with open(path) as f:
            text = f.read()
        commit = re.search(r"^- commit: (\S+)", text, re.M)
        if not commit or commit.group(1) != _commit():
            sys.exit(f"--resume: {path} is of commit {commit and commit.group(1)}, this tree is {_commit()}")
        for m in re.finditer(r"^\| (.+?) \| pass \| (.*) \|$", text, re.M):
            self.results[m.group(1)] = (True, m.group(2))
        for key in ("device", "jax"):  # until this run's workers say
            if m := re.search(rf"^- {key}: (.+)$", text, re.M):
                setattr(self, key, m.group(1))

    def record(self, name: str, ok: bool, detail: str):
        self.results[name] = (ok, detail)
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if self.md:
            write_md(self.md, self, [])


def run_line(fn) -> tuple[bool, str]:
    """One line in this process: (passed, detail with its time). A failed line is reported
    with its exception; the worker's other lines still run."""
    t = time.perf_counter()
    try:
        detail = fn() or ""
        ok = True
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    gc.collect()  # engines of this line (reference cycles) give their device memory back
    return ok, f"{detail} ({time.perf_counter() - t:.1f} s)"


def _on_gpu_kernels(eng):
    """The engine picked the GPU kernels ("auto" on a GPU); --cpu smoke runs skip this."""
    plan = eng.runner.plan
    assert _cpu_smoke or (plan.attn, plan.linear) == ("gpu", "gpu"), plan


# ---- speculative greedy == plain greedy --------------------------------------------------
def lossless(name: str, k: int, dtype: str) -> str:
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
    _on_gpu_kernels(eng)
    before = eng.stats()
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    d = h.stats_delta(before, eng.stats())
    after = eng.stats()
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    ties = []
    for i in bad:
        text, gap, top = divergence(prompts[i], got[i], want[i], dtype)
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
    return (f"mean acceptance length {d['mean_acceptance_length']:.2f}, preemptions {pre}, prefix-cache hits {hits}; "
            f"{len(prompts) - len(bad)} of {len(prompts)} outputs equal" + "".join(f"; {t}" for t in ties))


def mixed(name: str | None, k: int | None) -> str:
    """Mixed steps (issue 28: every decode row and a prefill chunk in one call) on the GPU
    kernels, plain or speculative: greedy == the unmixed plain engine's."""
    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(8, 1, 50, seed=5)
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in h.llm(None, dtype="float32").generate(prompts, sp)]
    llm = h.llm(name, k, dtype="float32", max_num_partial_prefills=1)
    eng = llm.engine
    _on_gpu_kernels(eng)
    before = eng.stats()
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    after = eng.stats()
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"outputs {bad} differ"
    n = after["num_mixed_steps"] - before["num_mixed_steps"]
    assert n > 0, "no mixed step ran"
    return f"{n} mixed steps, {after['num_preemptions'] - before['num_preemptions']} preemptions; 8 of 8 outputs equal"


def failed_step(name: str, k: int) -> str:
    """A step whose call took the donated buffers and then failed (as on the device's out of
    memory): the engine restores zeroed buffers (jspec/engine/recovery.py), preempts its
    running requests and finishes them with the plain greedy outputs, on the GPU kernels."""
    import jax

    import jspec
    from tests.helpers import spec_e2e as h

    prompts = h.varied_prompts(8, 1, 50, seed=0)
    sp = jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in h.llm(None, dtype="float32").generate(prompts, sp)]
    eng = h.llm(name, k, dtype="float32").engine  # the lossless line's engine: compiled
    _on_gpu_kernels(eng)
    r = eng.runner
    real, calls = r._spec_step, []

    def failing(*a, **kw):
        out = real(*a, **kw)
        calls.append(1)
        if len(calls) == 5:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: (gpu_check) a failure after the call")
        return out

    r._spec_step = failing
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
        r._spec_step = real
    assert len(failures) == 1 and failures[0] > 0, failures
    got = [done[f"failed_step{i}"] for i in range(len(prompts))]
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(prompts), f"{same} of {len(prompts)} outputs equal"
    return f"step 5 failed after its call; {failures[0]} requests preempted, {same} of {same} outputs == plain greedy"


def pool_from_memory() -> str:
    """The page pool sized from memory (default gpu_memory_utilization) is allocated and the
    engine runs: the embedded family (16 K/V arrays of ~6 GB on an H200) in float32. Its last
    array once found no free block in XLA's allocator and the first step ran out of memory
    (jspec/engine/kv_memory.py create_pools, which now tries again with fewer pages)."""
    import logging

    import jspec

    retries = []
    handler = logging.Handler()
    handler.emit = lambda rec: retries.append(rec.getMessage()) if "did not fit" in rec.getMessage() else None
    logging.getLogger("jspec.engine").addHandler(handler)
    try:
        llm = jspec.LLM(dtype="float32", max_num_seqs=8, max_model_len=256)
    finally:
        logging.getLogger("jspec.engine").removeHandler(handler)
    eng = llm.engine
    r = eng.runner
    _on_gpu_kernels(eng)
    outs = llm.generate([f"def f{i}(x):" for i in range(8)], jspec.SamplingParams(temperature=0, max_tokens=32))
    assert all(o.outputs[0].token_ids for o in outs)
    arrays = len(r.kv.k) + len(r.kv.v)
    return (f"{eng.num_pages} pages ({arrays} arrays of {r.kv.k[0].nbytes / 2**30:.2f} GiB) after "
            f"{len(retries)} smaller tries; 8 of 8 requests generated")


MEMORY_CHILD = """
import json, logging, jax, jspec
retries = []
handler = logging.Handler()
handler.emit = lambda rec: retries.append(1) if "did not fit" in rec.getMessage() else None
logging.getLogger("jspec.engine").addHandler(handler)
llm = jspec.LLM(dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.5)
s, kv = jax.devices()[0].memory_stats(), llm.engine.runner.kv
print("@@" + json.dumps({"limit": s["bytes_limit"], "in_use": s["bytes_in_use"], "retries": len(retries),
                         "kv": sum(a.nbytes for a in kv.k + kv.v), "pages": llm.engine.num_pages}))
"""


def memory_share() -> str:
    """vLLM's gpu_memory_utilization is a share of the whole device: in a fresh process the
    first engine sets JAX's pool to it, and its KV cache takes what the share leaves after
    the weights and 10% for XLA's temporaries (jspec/engine/kv_memory.py). Run before this
    process allocates anything (its group runs alone and first), so the child preallocates
    its pool as a user's process would (with XLA_PYTHON_CLIENT_PREALLOCATE=false the pool
    grows in pieces, and the KV arrays found no free block until 3 tries of 5% fewer pages)."""
    import jax

    from jspec import envs

    total = jax.devices()[0].memory_stats()["bytes_limit"] / envs.XLA_PYTHON_CLIENT_MEM_FRACTION
    env = {**_server_env(), "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD], env=env, capture_output=True, text=True, timeout=300)
    got = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    assert out.returncode == 0 and got, f"child exited with {out.returncode}: {out.stderr[-800:]}"
    r = json.loads(got[0][2:])
    pool, used = r["limit"] / total, r["in_use"] / total
    assert abs(pool - 0.5) < 0.01, f"JAX's pool is {pool:.3f} of the device, not 0.5"
    assert 0.43 < used <= 0.455 and r["retries"] == 0, \
        f"weights + KV cache hold {used:.3f} of the device, not ~0.45 ({r['retries']} smaller tries)"
    return (f"pool {pool:.3f} of the {total / 2**30:.1f} GiB device; weights + KV cache {used:.3f} "
            f"({r['pages']} pages, {r['kv'] / 2**30:.1f} GiB of KV, at the first try)")


def processors(name: str, k: int) -> str:
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
    _on_gpu_kernels(llm.engine)
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
    return (f"mean acceptance length {d['mean_acceptance_length']:.2f}; {len(prompts)} of {len(prompts)} outputs "
            f"equal; emitted logprobs within {err:.1e}")


def structured(method: str) -> str:
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
    want = [o.outputs[0].text for o in jspec.LLM(**kw).generate(prompts, sp)]
    llm = jspec.LLM(speculative_config={"method": method}, **kw)
    _on_gpu_kernels(llm.engine)
    outs = llm.generate(prompts, sp)
    got = [o.outputs[0].text for o in outs]
    bad = [i for i, (o, s) in enumerate(zip(outs, sch)) if o.outputs[0].finish_reason != "stop" or not valid(got[i], s)]
    assert not bad, f"outputs {bad} unfinished or invalid: {[got[i] for i in bad[:2]]}"
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not differ, f"outputs {differ} differ from plain: {got[differ[0]]!r} vs {want[differ[0]]!r}"
    return (f"mean acceptance length {llm.engine.stats()['mean_acceptance_length']:.2f}; {len(sch)} of {len(sch)} "
            f"outputs valid and equal")


def divergence(prompt, got, want, dtype) -> str:
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


def fallback(refs) -> str:
    import jspec

    r = refs["qwen3_hd24"]
    # A fixed small page pool: sized from free memory it would keep most of the device
    # (until collected) from the server this script starts later.
    llm = jspec.LLM(os.path.join(_ckpts, "qwen3_hd24"), max_num_seqs=1, max_model_len=64, page_size=8, num_pages=32)
    _on_gpu_kernels(llm.engine)
    out = llm.generate([r["prompt"]], jspec.SamplingParams(temperature=0, max_tokens=FALLBACK_TOKENS,
                                                           ignore_eos=True))[0].token_ids
    assert out == r["greedy"], f"{out} vs transformers {r['greedy']}"
    return f"{FALLBACK_TOKENS} greedy tokens == transformers (float32)"


def moe_target(refs, method: str | None) -> str:
    """The Qwen3-MoE target's greedy output on the GPU == transformers' (float32), plain or
    speculating (``method`` "ngram": the K+1-row verification through the experts too)."""
    import jspec
    from tests.helpers import spec_e2e as h

    r = refs["qwen3_moe"]
    spec = None if method is None else h.spec_config(method, 3)
    llm = jspec.LLM(os.path.join(_ckpts, "qwen3_moe"), max_num_seqs=2, max_model_len=64, page_size=8, num_pages=32,
                    speculative_config=spec)
    _on_gpu_kernels(llm.engine)
    before = llm.engine.stats()
    outs = llm.generate(r["prompts"], jspec.SamplingParams(temperature=0, max_tokens=MOE_TOKENS, ignore_eos=True))
    for o, want in zip(outs, r["greedy"]):
        assert o.token_ids == want, f"{o.token_ids} vs transformers {want}"
    d = h.stats_delta(before, llm.engine.stats())
    extra = "" if spec is None else f"; mean acceptance length {d['mean_acceptance_length']:.2f}"
    return f"{len(outs)} x {MOE_TOKENS} greedy tokens == transformers (float32){extra}"


# ---- the rejection kernel ---------------------------------------------------------------
def rejection(method: str, with_probs: bool) -> str:
    import jax
    import jax.numpy as jnp

    from kernels_pallas.rejection_sampling import ref_rejection_sample, rejection_sample

    B, K, V = (16, 7, 3000) if _cpu_smoke else (16, 7, 128256)
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
    impl = "interpret" if _cpu_smoke else "gpu"
    got = jax.jit(lambda *a: rejection_sample(*a, impl=impl, **kw))(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    n = np.asarray(want[1])
    assert len(set(n.tolist())) > 2, n  # several acceptance lengths: not a vacuous batch
    return f"B={B} K={K} V={V}: tokens and counts equal; counts {sorted(set(n.tolist()))}"


# ---- warmup and the server --------------------------------------------------------------
def warmup(name: str, k: int) -> str:
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
    return f"{n} shapes compiled, none after; outputs == plain greedy"


def _server_env() -> dict:
    """The server runs as it would alone: XLA's default preallocation, not this process's."""
    env = dict(os.environ)
    if env.pop("_GPU_CHECK_PREALLOC_UNSET", None):
        del env["XLA_PYTHON_CLIENT_PREALLOCATE"]
    return env


def serve(name: str, k: int) -> str:
    import httpx

    import jspec
    from tests.helpers import spec_e2e as h

    folder, _ = h.target()
    port = 8765
    spec = json.dumps({"method": h.METHOD[name], "model": h.drafter(name), "num_speculative_tokens": k})
    # 0.75 of the device, JAX's default pool: vLLM's 0.9 would leave the side-by-side workers ~8 GB
    cmd = [sys.executable, "-m", "jspec.serve", "--model", folder, "--port", str(port), "--max-num-seqs", "2",
           "--max-model-len", "56", "--page-size", "16", "--warmup", "on", "--speculative-config", spec,
           "--gpu-memory-utilization", "0.75"]
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_check_serve.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**_server_env(), "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} (log: gpu_check_serve.log)")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not healthy after 300 s")
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
        return f"warmed up ({warm[-1].split('warmup:')[-1].strip()}), one completion == plain greedy"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ---- quick performance table ------------------------------------------------------------
def perf(steps: int) -> list[dict]:
    """Batch 1, ctx 512, bf16, through LLMEngine.step (bench.py's engine_decode): plain
    Llama-3.1-8B, EAGLE3 K=3 at synthetic acceptance length 3.5, DFlash block 16 at 6.5
    (on the same Llama shape, to keep the call short), each beside the physical ideal
    tau * T(1) / (T(1) + drafter weight bytes / bandwidth), bandwidth probed here."""
    import bench
    import jax
    import jax.numpy as jnp

    from jspec.checkpoint.target import target_param_spec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    bw = bench.measure_bandwidth(False)["best_TBps"] * 1e12
    cfg = bench.LLAMA_8B
    params = bench.random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    ctx = 512
    base = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16")
    t1, tps1, _ = bench.engine_decode(base, 1, ctx, rng, steps)
    rows = [dict(method="plain", K=0, tau=1.0, tok_s=tps1, speedup=1.0, t1_ms=t1 * 1e3, bw_TBps=bw / 1e12,
                 roofline_frac=bench.weight_bytes(params) / bw / t1)]
    for kind, K, length in (("eagle3", 3, 3.5), ("dflash", 15, 6.5)):
        # The target forward verifying K + 1 tokens against decoding one, by GPU time (what
        # the device spends; a synchronised single call's wall time adds the host's launches).
        gpu = jax.default_backend() == "gpu"
        tk = bench.target_forward_time(base, 1, ctx, rng, K + 1, gpu_time=gpu)
        tk = tk / bench.target_forward_time(base, 1, ctx, rng, 1, gpu_time=gpu)
        dc, dparams = bench.drafter_setup(kind, cfg, False)
        dbytes = bench.drafter_stream_bytes(cfg, dc, dparams)
        spec = {"method": kind, "model": f"random-{kind}", "num_speculative_tokens": K,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
        eng = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16", spec=spec,
                                drafter=(dc, dparams), extra=(steps + 8) * (K + 1) + 64)
        td = bench.draft_time(eng, 1, ctx, rng, K)
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
        _, tps, _ = bench.engine_decode(eng, 1, ctx, rng, steps)
        tau = eng.spec_metrics.mean_acceptance_length
        ideal = bench.physical_ideal(tau, t1, dbytes, bw)
        rows.append(dict(method=f"{kind} K={K}", K=K, tau=tau, tok_s=tps, speedup=tps / tps1, ideal=ideal,
                         frac_of_ideal=tps / tps1 / ideal, tk1_over_t1=tk, draft_ms=td * 1e3,
                         draft_bound_ms=dbytes / bw * 1e3, draft_over_bound=td / (dbytes / bw)))
        del eng
        jax.clear_caches()
    return rows


def perf_table(rows) -> list[str]:
    p = rows[0]
    out = [f"Bandwidth probe (best of f32 copy, bf16 column sum, bf16 GEMV): {p['bw_TBps']:.2f} TB/s. "
           f"Plain decode: {p['tok_s']:.1f} tok/s, T(1) {p['t1_ms']:.2f} ms, {p['roofline_frac']:.1%} of the "
           "weight-streaming roofline.", "",
           "| method | tau | tok/s | speedup over plain | physical ideal | of ideal | forward T(K+1) / T(1), GPU time "
           "| draft time (GPU) | drafter bytes / bandwidth |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows[1:]:
        out.append(f"| {r['method']} | {r['tau']:.2f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['ideal']:.2f}x "
                   f"| {r['frac_of_ideal']:.1%} | {r['tk1_over_t1']:.2f} | {r['draft_ms']:.2f} ms "
                   f"| {r['draft_bound_ms']:.2f} ms ({r['draft_over_bound']:.2f}x) |")
    return out


def _commit() -> str:
    """The commit checked: JSPEC_COMMIT, else git's HEAD, marked when jspec/ or kernels_pallas/
    differ from it (the device machine's copy of the tree can carry a stale .git with the
    newer files as uncommitted changes: a report must not name a commit it did not run)."""
    commit = os.environ.get("JSPEC_COMMIT")
    if not commit:
        try:
            git = ["git", "-C", ROOT]
            commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            dirty = subprocess.run(git + ["status", "--porcelain", "--", "jspec", "kernels_pallas"],
                                   capture_output=True, text=True).stdout.strip()
            commit = (commit or "unknown") + (" with uncommitted changes to jspec/ or kernels_pallas/" if dirty else "")
        except OSError:
            commit = "unknown"
    return commit


def code_digest() -> str:
    """sha256 (12 hex digits) of every file under jspec/ and kernels_pallas/ (paths and bytes,
    caches left out): the code a report ran, comparable with ``--digest`` at any checkout."""
    h = hashlib.sha256()
    for top in ("jspec", "kernels_pallas"):
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def write_md(path: str, report: Report, perf_lines: list[str]):
    commit = _commit()
    passed = sum(ok for _, ok, _ in report.lines)
    lines = ["# GPU check", "",
             "Written by `scripts/gpu_check.py` (see its docstring for how to run it); overwritten each run.", "",
             f"- commit: {commit}", f"- code digest (`--digest`): {code_digest()}", f"- date: {datetime.date.today().isoformat()}",
             f"- device: {report.device}", f"- jax: {report.jax}",
             f"- result: {passed} of {len(report.lines)} lines pass", "",
             "| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'pass' if ok else '**FAIL**'} | {d.replace('|', '/')} |" for n, ok, d in report.lines]
    with open(path, "w") as f:
        f.write("\n".join(lines + _perf_section(perf_lines)) + "\n")


PERF_HEADING = "## Quick performance table (batch 1, ctx 512, bf16, random Llama-3.1-8B shape)"


def _perf_section(perf_lines: list[str]) -> list[str]:
    return ["", PERF_HEADING, ""] + perf_lines if perf_lines else []


def replace_perf(path: str, perf_lines: list[str]):
    """--perf-only: the report at ``path`` (a --no-perf run's) with its table section
    replaced by this run's, and the commit of this run beside it."""
    with open(path) as f:
        text = f.read()
    head = text.split("\n" + PERF_HEADING)[0].rstrip("\n").split("\n")
    note = [f"(the table's run: commit {_commit()}, code digest {code_digest()}, {datetime.date.today().isoformat()}, "
            "separate device call)", ""]
    with open(path, "w") as f:
        f.write("\n".join(head + _perf_section(note + perf_lines)) + "\n")


_ckpts = ""
_cpu_smoke = False


# ---- the lines, and who runs them -------------------------------------------------------
# Each line runs in a worker process of its group; the groups run side by side (the lines are
# mostly compilation, on the host's cores, and their engines are small), except ALONE, which
# runs first with the device to itself (it sizes a page pool from free memory). A group keeps
# together the lines that share engines (tests/helpers/spec_e2e.py caches them per process).
# The server of the serve line preallocates 75% of the device (--gpu-memory-utilization): the
# others hold fixed small page pools and allocate on demand.
ALONE = "pool"


def line_table(refs) -> list[tuple[str, str, object]]:
    """(group, name, check) for every line, in the report's order."""
    t = [("serve", "python -m jspec.serve with a drafter answers a completion", lambda: serve("eagle3", 3)),
         (ALONE, "gpu_memory_utilization=0.5 in a fresh process: JAX's pool and the KV cache are that share of the "
                 "device", memory_share),
         (ALONE, "the page pool sized from memory is allocated and runs: the family, float32", pool_from_memory)]
    groups = {"eagle3": "eagle3", "eagle3_full": "eagle3_more", "eagle3_orig": "eagle3_more", "peagle": "peagle",
              "dflash4": "dflash", "dflash8_zlab": "dflash", "draft_llama": "draft_model"}
    for name, k, what in DRAFTERS:
        for dtype in ("float32", "bfloat16"):
            t.append((groups[name], f"spec greedy == plain greedy: {what}, K={k}, {dtype}",
                      lambda name=name, k=k, dtype=dtype: lossless(name, k, dtype)))
    for dtype in ("float32", "bfloat16"):  # no checkpoint: the drafts come from the sequence
        t.append(("peagle", f"spec greedy == plain greedy: n-gram (prompt lookup 1..3), K=3, {dtype}",
                  lambda dtype=dtype: lossless("ngram", 3, dtype)))
    for name, k in (("eagle3", 3), ("dflash4", 3)):
        t.append((groups[name], f"penalties, logit_bias, logprobs: spec greedy == plain greedy: {name}, K={k}, float32",
                  lambda name=name, k=k: processors(name, k)))
    for m in ("eagle3", "dflash"):
        t.append((f"structured_{m}", "structured outputs (16 JSON schemas): spec greedy == plain greedy, all valid: "
                  f"family {m}, float32", lambda m=m: structured(m)))
    for name, k, g in ((None, None, "eagle3_more"), ("eagle3", 3, "eagle3"), ("dflash8_zlab", 7, "dflash"),
                       ("ngram", 3, "peagle"), ("draft_llama", 3, "draft_model")):
        t.append((g, f"mixed steps: greedy == unmixed plain greedy: {name or 'plain'}, float32",
                  lambda name=name, k=k: mixed(name, k)))
    t.append(("eagle3", "a step that fails on the device after its call: the engine serves on: eagle3, K=3, float32",
              lambda: failed_step("eagle3", 3)))
    t.append(("peagle", "head_dim 24 runs on the XLA path == transformers", lambda: fallback(refs)))
    t.append(("draft_model", "a Qwen3 mixture-of-experts target == transformers: plain, float32",
              lambda: moe_target(refs, None)))
    t.append(("draft_model", "a Qwen3 mixture-of-experts target == transformers: n-gram K=3, float32",
              lambda: moe_target(refs, "ngram")))
    for method, probs, what in (("standard", False, "greedy + sampled rows, no draft probs"),
                                ("standard", True, "probabilistic, with draft probs"),
                                ("synthetic", False, "synthetic acceptance")):
        t.append(("peagle", f"rejection kernel == reference: {what}",
                  lambda method=method, probs=probs: rejection(method, probs)))
    t.append(("eagle3", "LLMEngine.warmup() with a drafter (EAGLE3)", lambda: warmup("eagle3", 3)))
    t.append(("dflash", "LLMEngine.warmup() with a drafter (DFlash)", lambda: warmup("dflash4", 3)))
    return t


_workers: list = []  # their processes, stopped with this one (a device call's time limit)


def _stop_workers(signum, frame):
    for p in _workers:
        if p.poll() is None:
            p.terminate()
    sys.exit(128 + signum)


MARK = "@@gpu_check "  # a worker's results on its stdout, one JSON object a line


def _emit(obj: dict):
    print(MARK + json.dumps(obj), flush=True)


def _check_backend():
    import jax

    if jax.default_backend() != "gpu" and not _cpu_smoke:
        sys.exit(f"gpu_check needs a GPU; jax's backend is {jax.default_backend()!r}")


def worker(group: str, names: list[str], perf_steps: int):
    """--worker: run ``names`` of ``group`` (or the performance table) in this process and
    report each on stdout."""
    import jax

    _check_backend()
    _emit({"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "jax": jax.__version__})
    if group == "perf":
        return _emit({"perf": perf_table(perf(perf_steps))})
    refs = use_checkpoints(_ckpts)
    for g, name, fn in line_table(refs):
        if g == group and name in names:
            ok, detail = run_line(fn)
            _emit({"name": name, "ok": ok, "detail": detail})


def spawn(group: str, names: list[str], args, rep: Report | None, lock) -> dict:
    """Run a worker process for ``group``; relay its output (each line prefixed with the
    group) and record its results. Lines it never reported (it died) are failures. Returns
    its last non-line message (the performance table's)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", group, "--ckpts", _ckpts,
           "--perf-steps", str(args.perf_steps)] + (["--cpu"] if _cpu_smoke else [])
    env = {**os.environ, "_GPU_CHECK_LINES": json.dumps(names)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    _workers.append(proc)
    last, seen = {}, set()
    for ln in proc.stdout:
        if not ln.startswith(MARK):
            print(f"[{group}] {ln}", end="", flush=True)
            continue
        msg = json.loads(ln[len(MARK):])
        with lock:
            if "name" in msg and rep is not None:
                seen.add(msg["name"])
                rep.record(msg["name"], msg["ok"], msg["detail"])
            elif "device" in msg and rep is not None:
                rep.device, rep.jax = msg["device"], msg["jax"]
            else:
                last = msg
    rc = proc.wait()
    with lock:
        for name in names:
            if name not in seen and rep is not None:
                rep.record(name, False, f"its worker ({group}) exited with code {rc} before reporting it")
    if group == "perf" and "perf" not in last:
        raise RuntimeError(f"the performance table's worker exited with code {rc}")
    return last


def main():
    global _ckpts, _cpu_smoke
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", metavar="DIR", help="build the tiny checkpoints and references into DIR (CPU)")
    ap.add_argument("--ckpts", metavar="DIR", default=".gpu_check", help="the folder --build wrote")
    ap.add_argument("--md", default=os.path.join(ROOT, "docs", "gpu_check.md"), help="where to write the report")
    ap.add_argument("--perf-steps", type=int, default=24, help="timed steps per row of the performance table")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--perf-only", action="store_true", help="only the performance table, written into the "
                    "existing report at --md in place of its table section")
    ap.add_argument("--resume", action="store_true", help="keep the passing lines of the report at --md (a "
                    "run of this commit cut short by a time limit) and run only the others")
    ap.add_argument("--only", default="", help="run only the lines matching this regex (debugging)")
    ap.add_argument("--workers", type=int, default=8, help="worker processes at once (1: one group at a time)")
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (jnp references, no perf)")
    ap.add_argument("--digest", action="store_true", help="print this checkout's code digest (a report's header) and exit")
    ap.add_argument("--worker", metavar="GROUP", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.digest:
        return print(code_digest())
    if args.build:
        return build(args.build)
    _cpu_smoke = args.cpu
    _ckpts = os.path.abspath(args.ckpts)
    if args.worker:
        return worker(args.worker, json.loads(os.environ.get("_GPU_CHECK_LINES", "[]")), args.perf_steps)
    if args.perf_only:
        _check_backend()
        if not os.path.exists(args.md):
            sys.exit(f"--perf-only rewrites an existing report; {args.md} does not exist")
        lines = perf_table(perf(args.perf_steps))
        print("\n".join(lines), flush=True)
        return replace_perf(args.md, lines)
    # This process touches no device: the workers do, and the serve line's server sizes its
    # page pool from what the device has.
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    signal.signal(signal.SIGTERM, _stop_workers)

    table = [(g, n) for g, n, _ in line_table(use_checkpoints(_ckpts))]
    rep = Report([n for _, n in table], args.md)
    if args.resume and os.path.exists(args.md):
        rep.resume(args.md)
    todo: dict[str, list[str]] = {}
    for g, n in table:
        if (not args.only or re.search(args.only, n)) and n not in rep.results:
            todo.setdefault(g, []).append(n)
    lock = threading.Lock()
    t0 = time.perf_counter()
    if ALONE in todo:
        spawn(ALONE, todo.pop(ALONE), args, rep, lock)
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        for job in [pool.submit(spawn, g, names, args, rep, lock) for g, names in todo.items()]:
            job.result()
    print(f"lines done in {time.perf_counter() - t0:.0f} s", flush=True)
    perf_lines = []
    if not (args.no_perf or _cpu_smoke):
        try:  # alone on the device, in a process of its own
            perf_lines = spawn("perf", [], args, None, lock)["perf"]
        except Exception as e:
            traceback.print_exc()
            rep.results["quick performance table"] = (False, f"{type(e).__name__}: {e}")
            rep.names.append("quick performance table")
        print("\n".join(perf_lines), flush=True)
    write_md(args.md, rep, perf_lines)
    print(f"wrote {args.md}")
    sys.exit(0 if all(ok for _, ok, _ in rep.lines) else 1)


if __name__ == "__main__":
    main()
