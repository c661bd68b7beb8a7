"""Issue 26, host-side SamplingParams fields on the embedded family (a real BPE tokenizer,
multi-character tokens): ``stop`` strings (spanning token boundaries, the text cut as vLLM
cuts it, finish_reason / stop_reason), ``include_stop_str_in_output``, ``min_tokens``
(EOS and stop tokens masked, stop strings ignored until reached), and ``n`` (n seeded
samples in one RequestOutput: reproducible, distinct, sample i == a request with seed + i),
without speculation and with the family's EAGLE3 drafter (several tokens per step: a stop
inside an accepted run drops the rest)."""

from __future__ import annotations

import pytest

import jspec
from jspec import family

PROMPTS = ["def parse(", "import os\n\n\nclass ", "    for i in range("]
MAX = 24
KW = dict(max_num_seqs=4, max_model_len=128, dtype="float32")
_LLM: dict = {}


def llm(spec: bool) -> jspec.LLM:
    if spec not in _LLM:
        _LLM[spec] = jspec.LLM(family.TARGET, speculative_config={"method": "eagle3"} if spec else None, **KW)
    return _LLM[spec]


def greedy(engine, **kw):
    return engine.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, **kw))


def spanning_stop(tok, ids):
    """A stop string made of the end of one token's text and the start of the next's, whose
    first occurrence in the decoded output ends inside the later token: (string, index of
    that token)."""
    for i in range(2, len(ids) - 1):
        a, b = tok.decode(ids[i - 1 : i]), tok.decode(ids[i : i + 1])
        if len(a) < 2 or len(b) < 2 or "\ufffd" in a + b:
            continue
        s = a[-2:] + b[:2]
        before = tok.decode(ids[:i - 1])
        text = tok.decode(ids[: i + 1])
        if s not in before + a and text.find(s) == len(before) + len(a) - 2:
            return s, i
    return None


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_stop_strings_span_tokens_and_cut_the_text(spec):
    eng = llm(spec)
    tok = eng.get_tokenizer()
    base = greedy(eng)
    checked = 0
    for prompt, o in zip(PROMPTS, base):
        found = spanning_stop(tok, o.token_ids)
        if found is None:
            continue
        s, i = found
        full = tok.decode(o.token_ids)
        for include in (False, True):
            out = eng.generate([prompt], jspec.SamplingParams(
                temperature=0, max_tokens=MAX, ignore_eos=True, stop=[s, "never-in-the-output-\x01"],
                include_stop_str_in_output=include))[0]
            # token_ids end with the token that completed the string; the text is cut at it.
            assert out.token_ids == o.token_ids[: i + 1], (s, i)
            cut = full.index(s) + (len(s) if include else 0)
            assert out.text == out.outputs[0].text == full[:cut]
            assert out.finish_reason == "stop" and out.stop_reason == s == out.outputs[0].stop_reason
        checked += 1
    assert checked >= 2, "no output had a usable token boundary: the test would be vacuous"
    # A stop string that never appears: the output runs to max_tokens, its text not cut.
    o = eng.generate([PROMPTS[0]], jspec.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True,
                                                        stop="\x01\x02"))[0]
    assert o.token_ids == base[0].token_ids and o.finish_reason == "length" and o.stop_reason is None
    assert o.text == tok.decode(base[0].token_ids)


def test_stop_token_ids_report_stop_reason_and_min_tokens_defers_them():
    eng = llm(False)
    base = greedy(eng)[0].token_ids
    stop_tok = base[3]
    first = base.index(stop_tok)
    o = eng.generate([PROMPTS[0]], jspec.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop_tok]))[0]
    assert o.token_ids == base[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    # min_tokens past its first occurrence: the token is masked until then, the output goes on.
    n_min = first + 2
    o = eng.generate([PROMPTS[0]], jspec.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop_tok],
                                                        min_tokens=n_min))[0]
    assert stop_tok not in o.token_ids[:n_min]
    assert len(o.token_ids) > n_min or o.finish_reason == "length"
    if o.finish_reason == "stop":
        assert o.token_ids[-1] == stop_tok and o.token_ids.count(stop_tok) == 1


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_min_tokens_masks_eos_and_defers_stop_strings(spec):
    eng = llm(spec)
    eos = sorted(eng.engine.eos_token_ids)
    # EOS pushed to the top: without min_tokens the first token is EOS...
    push = {t: 60.0 for t in eos}
    o = eng.generate([PROMPTS[1]], jspec.SamplingParams(temperature=0, max_tokens=MAX, logit_bias=push))[0]
    assert o.token_ids[0] in eos and o.finish_reason == "stop" and len(o.token_ids) == 1
    # ...with min_tokens = 5 EOS is masked for 5 tokens and comes 6th.
    o = eng.generate([PROMPTS[1]], jspec.SamplingParams(temperature=0, max_tokens=MAX, logit_bias=push,
                                                        min_tokens=5))[0]
    assert len(o.token_ids) == 6 and o.token_ids[-1] in eos and not set(o.token_ids[:5]) & set(eos)
    assert o.finish_reason == "stop" and o.stop_reason is None
    # A stop string inside the first min_tokens tokens does not end the output.
    tok = eng.get_tokenizer()
    ids = greedy(eng)[0].token_ids
    s = tok.decode(ids[:2])[-2:]
    o = eng.generate([PROMPTS[0]], jspec.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=s,
                                                        min_tokens=10))[0]
    assert len(o.token_ids) > 10 and o.token_ids[:10] == ids[:10]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_n_samples_reproducible_distinct_and_seeded_per_sample(spec):
    eng = llm(spec)
    sp = jspec.SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = eng.generate(PROMPTS[:2], sp)
    b = eng.generate(PROMPTS[:2], sp)
    for oa, ob in zip(a, b):
        assert oa.finished and len(oa.outputs) == 4 and [c.index for c in oa.outputs] == [0, 1, 2, 3]
        samples = [tuple(c.token_ids) for c in oa.outputs]
        assert samples == [tuple(c.token_ids) for c in ob.outputs], "same seed, different samples"
        assert len(set(samples)) == 4, "the four samples should differ"
        assert oa.token_ids == oa.outputs[0].token_ids and oa.text == oa.outputs[0].text
        assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in oa.outputs)
    # Sample i is the request with seed + i (vLLM's children), alone.
    for i in (0, 3):
        alone = eng.generate([PROMPTS[0]], jspec.SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12,
                                                                ignore_eos=True))[0]
        assert alone.token_ids == a[0].outputs[i].token_ids
    # A different request seed gives different samples.
    c = eng.generate(PROMPTS[:1], jspec.SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert [x.token_ids for x in c[0].outputs] != [x.token_ids for x in a[0].outputs]


def test_n_streams_through_step_and_aborts_as_one_request():
    eng = llm(False).engine
    eng.add_request("grp", PROMPTS[0], jspec.SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                            ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "grp" and len(o.outputs) == 3
            seen.append(o)
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    assert all(len(c.token_ids) == 8 for c in seen[-1].outputs)
    # Streamed deltas add up to each sample's tokens.
    for i in range(3):
        assert sum((o.outputs[i].new_token_ids for o in seen), []) == seen[-1].outputs[i].token_ids
    eng.add_request("grp2", PROMPTS[1], jspec.SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request("grp2")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_free_pages == eng.num_pages
