"""Issue 28 end to end: decode rows and prefill chunks in the same step (one flat step,
jspec/engine/flat_runner.py).

One small engine, every shape compiled by warmup (5, each without and with top-k / top-p
filtering: decode at N 1 / 2, general steps of 8, 16 and 18 tokens: 2 decode rows and a
16-token chunk at most), serving requests that arrive at random steps: outputs equal each
request run alone (greedy and seeded T=1) and transformers' greedy, the running stream gets
a token in every step while a long prompt prefills, and nothing compiles after warmup.
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers.engine import drive, precompile_then_warmup
from tests.helpers.targets import hf_greedy, random_prompt

pytestmark = pytest.mark.production_buckets  # about the real shape buckets (tests/conftest.py)


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    llm = jspec.LLM(llama_ckpt[0], max_num_seqs=2, max_model_len=64, page_size=16, max_prefill_chunk=16,
                    max_num_partial_prefills=1)
    # compiled ahead on two threads, as warmup does on an accelerator (jspec/engine/warmup.py, prepare)
    ahead, in_warmup = precompile_then_warmup(llm.engine)
    assert ahead >= len(llm.engine.warmup_shapes()) and in_warmup == 0
    return llm


def test_warmup_compiles_every_shape(llm):
    eng = llm.engine
    shapes = eng.warmup_shapes()
    assert sorted(s for s in shapes if s.filtering == "off") == [
        (1, 1, 1, True, "off"), (2, 2, 1, True, "off"), (8, 2, 0, False, "off"), (16, 2, 0, False, "off"),
        (18, 2, 0, False, "off")]
    assert len(shapes) == 2 * 5  # and each with top-k / top-p filtering
    assert eng.runner.num_compilations + eng.runner.num_loaded == len(shapes)


def test_random_arrivals_match_each_request_alone(llm, llama_ckpt):
    """Greedy and seeded T=1 requests arriving at random steps (max_num_seqs 2: decodes,
    chunks and waiting requests mix); every output equals that request run alone, the
    greedy ones transformers' too, and no step compiles anything."""
    eng, hf = llm.engine, llama_ckpt[1]
    n = eng.runner.num_compilations
    rng = np.random.default_rng(28)
    script, reqs = {}, {}
    for i in range(6):
        prompt = random_prompt(rng, int(rng.integers(2, 46)))
        sp = jspec.SamplingParams(max_tokens=int(rng.integers(6, 12)), ignore_eos=True,
                                  **(dict(temperature=0.0) if i % 2 else dict(temperature=1.0, seed=100 + i)))
        script.setdefault(int(rng.integers(0, 14)), []).append(("add", f"r{i}", prompt, sp))
        reqs[f"r{i}"] = (prompt, sp)
    mixed = eng.runner.num_mixed_steps
    done = drive(llm, script)
    assert eng.runner.num_mixed_steps - mixed >= 3
    assert eng.runner.num_compilations == n
    assert eng.num_free_pages == eng.num_pages
    for rid, (prompt, sp) in reqs.items():
        toks, reason = done[rid]
        assert reason == "length" and len(toks) == sp.max_tokens
        assert toks == llm.generate([prompt], sp)[0].token_ids, rid
        if sp.temperature == 0.0:
            assert toks == hf_greedy(hf, prompt, sp.max_tokens), rid
    assert eng.runner.num_compilations == n


def test_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(llm):
    eng = llm.engine
    rng = np.random.default_rng(1)
    greedy = dict(temperature=0.0, ignore_eos=True)
    eng.add_request("s", random_prompt(rng, 5), jspec.SamplingParams(max_tokens=30, **greedy))
    while not eng.step():
        pass
    eng.add_request("long", random_prompt(rng, 45), jspec.SamplingParams(max_tokens=2, **greedy))
    mixed, steps, first = eng.runner.num_mixed_steps, 0, None
    while first is None:
        outs = {o.request_id: o for o in eng.step()}
        steps += 1
        assert "s" in outs, f"the stream got no token in step {steps}"
        first = outs["long"].token_ids if "long" in outs else None
    assert eng.runner.num_mixed_steps - mixed == 3  # 45 prompt tokens in chunks of 16, beside the stream
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_free_pages == eng.num_pages
