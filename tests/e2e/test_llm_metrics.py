"""jspec.LLM's vLLM offline metrics (``LLM.get_metrics()``, jspec/metrics_reader.py), read
the way vLLM's speculative-decoding example reads them, and ``LLM.reset_prefix_cache()``."""

from __future__ import annotations

import jspec
from jspec.metrics_reader import Counter, Gauge, Vector
from tests.helpers import spec_e2e as h


def _by_name(metrics) -> dict:
    return {m.name: m for m in metrics}


def test_get_metrics_counts_as_vllm_example_reads_them():
    llm = h.llm("dflash4", 3)  # shared with the lossless tests: compiled already
    prompts = h.varied_prompts(2, 5, 20, seed=21)
    sp = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    m0 = _by_name(llm.get_metrics())
    outs = llm.generate(prompts, sp)
    m1 = _by_name(llm.get_metrics())
    assert all(m.labels == {"model_name": llm.engine.model_name, "engine": "0"} for m in m1.values())

    def d(name):
        assert isinstance(m1[name], Counter), m1[name]
        return m1[name].value - m0[name].value

    assert d("vllm:num_preemptions") == 0
    assert d("vllm:prompt_tokens") == sum(len(p) for p in prompts)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert d("vllm:generation_tokens") == generated
    # vLLM's example: acceptance from the counters and the per-position Vector
    drafts, draft_tokens, accepted = (d(f"vllm:spec_decode_num_{k}") for k in ("drafts", "draft_tokens",
                                                                               "accepted_tokens"))
    per_pos = m1["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 3
    per_pos = [a - b for a, b in zip(per_pos.values, m0["vllm:spec_decode_num_accepted_tokens_per_pos"].values)]
    assert drafts > 0 and draft_tokens == 3 * drafts and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position i accepted only after i - 1
    # each verification emits its accepted drafts and one token of the target, the prompt's
    # step one more; max_tokens may cut a request's last verification (by up to K tokens):
    # against the tokens the outputs hold, counted independently
    assert 0 <= len(prompts) + drafts + accepted - generated <= 3 * len(prompts)
    assert accepted == sum(o.metrics.num_accepted_tokens for o in outs)
    assert isinstance(m1["vllm:num_requests_running"], Gauge) and m1["vllm:num_requests_running"].value == 0


def test_prefix_cache_metrics_count_tokens_and_reset():
    llm = h.llm("dflash4", 3)
    prompt = h.varied_prompts(1, 40, 40, seed=22)[0]
    sp = jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    m0 = _by_name(llm.get_metrics())
    want = llm.generate([prompt], sp)[0].token_ids
    assert llm.generate([prompt], sp)[0].token_ids == want
    m1 = _by_name(llm.get_metrics())
    # vLLM counts tokens: each lookup's prompt, and the tokens a hit served (two full pages of 16)
    assert m1["vllm:prefix_cache_queries"].value - m0["vllm:prefix_cache_queries"].value == 2 * len(prompt)
    assert m1["vllm:prefix_cache_hits"].value - m0["vllm:prefix_cache_hits"].value == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], sp)[0].token_ids == want
    m2 = _by_name(llm.get_metrics())
    assert m2["vllm:prefix_cache_hits"].value == m1["vllm:prefix_cache_hits"].value  # nothing was left to hit
    assert llm.llm_engine is llm.engine


def test_reset_prefix_cache_refused_while_a_request_holds_pages():
    llm = h.llm("dflash4", 3)
    eng = llm.engine
    eng.add_request("held", h.varied_prompts(1, 30, 30, seed=23)[0],
                    jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(3):  # admitted within a step or two (a call still in flight is read first)
        eng.step()
        if eng.blocks.ref.count(0) < len(eng.blocks.ref):
            break
    assert llm.reset_prefix_cache() is False
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.reset_prefix_cache() is True
