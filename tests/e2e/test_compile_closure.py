"""The set of compiled programs is closed (issue 57): after ``LLMEngine.warmup()`` no request
compiles anything, whatever its prompt length, max_tokens, arrival step or sampling
(greedy, seeded, top-k / top-p), with and without each drafter method, through
``LLMEngine.step`` (as ``LLM.generate`` drives it) and through the server's routes. The
engines mix decode rows with prefill chunks (the server's default), so steps of every
kind meet: prefill only, decode only, verification, mixed."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import jspec
from tests.helpers import spec_e2e as h
from tests.helpers.engine import drive

pytestmark = pytest.mark.production_buckets  # about the real shape buckets (tests/conftest.py)

# (drafter, K): every method (a draft model, n-gram), and plain decoding
CASES = [(None, None), ("eagle3", 3), ("peagle", 3), ("dflash4", 3), ("draft_llama", 3), ("ngram", 3)]


def random_params(rng, i: int) -> jspec.SamplingParams:
    kind = i % 3
    sampling = [dict(temperature=0.0), dict(temperature=0.8, seed=i), dict(temperature=1.0, top_p=0.9, top_k=20, seed=i)]
    return jspec.SamplingParams(max_tokens=int(rng.integers(1, 14)), ignore_eos=True, **sampling[kind])


@pytest.mark.parametrize("name,k", CASES, ids=[c[0] or "plain" for c in CASES])
def test_nothing_compiles_after_warmup(name, k):
    llm = h.llm(name, k, max_num_partial_prefills=1)
    eng = llm.engine
    eng.warmup()
    n = eng.runner.num_compilations
    assert n == len(eng.warmup_shapes())
    rng = np.random.default_rng(57)
    script = {}
    for i, prompt in enumerate(h.varied_prompts(8, 1, 45, seed=57)):
        script.setdefault(int(rng.integers(0, 16)), []).append(("add", f"r{i}", prompt, random_params(rng, i)))
    done = drive(llm, script)
    assert len(done) == 8 and eng.num_free_pages == eng.num_pages
    assert eng.stats()["num_mixed_steps"] > 0  # decode rows beside a prefill chunk
    assert eng.runner.num_compilations == n, "a request compiled a program"
    # The server's routes over the same engine: requests sent concurrently, arriving as the
    # engine loop steps.
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    prompts = h.varied_prompts(6, 1, 40, seed=58)

    def post(http, i):
        p = random_params(rng, i)
        r = http.post("/v1/completions", json={
            "model": "m", "prompt": prompts[i], "max_tokens": p.max_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"] == p.max_tokens

    with TestClient(create_app(eng, "m")) as http, concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(pool.map(lambda i: post(http, i), range(len(prompts))))
    assert eng.runner.num_compilations == n, "a server request compiled a program"
