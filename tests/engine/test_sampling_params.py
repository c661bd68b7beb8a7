"""Issue 26: every bad SamplingParams value is a ValueError naming the field, from the
constructor (values alone) or from the engine (token ids outside the vocabulary, logprobs
above max_logprobs, stop / bad_words without a tokenizer), while a request already
running completes untouched."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from tests.helpers.targets import VOCAB, random_prompt

BAD = [
    ({"n": 0}, "n must be an integer >= 1"),
    ({"n": 2.0, "temperature": 1.0}, "n must be an integer"),
    ({"n": 3, "temperature": 0}, "n must be 1 with greedy"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens must be an integer in"),
    ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens must be an integer in \[0, max_tokens=10\]"),
    ({"logprobs": -2}, "logprobs must be None, -1"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs must be None, -1"),
    ({"stop": [""]}, "stop must not contain an empty string"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"bad_words": ["ok", ""]}, "bad_words must not contain an empty string"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must contain token ids >= 0"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids must contain integer token ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must contain integer token ids"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias key 'x' is not a token id"),
    ({"logit_bias": {3: "big"}}, "logit_bias entry 3"),
    ({"logit_bias": [3, 1.0]}, "logit_bias must be a dict"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
]


@pytest.mark.parametrize("kwargs, match", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jspec.SamplingParams(**kwargs)


def test_values_are_normalised_as_vllm():
    sp = jspec.SamplingParams(stop="x", logit_bias={"5": 300, 7: -250.5}, logprobs=True, bad_words=["a", "a"],
                              allowed_token_ids=np.array([3, 4]), temperature=0.5, n=2)
    assert sp.stop == ("x",) and sp.bad_words == ("a",) and sp.logprobs == 1
    assert sp.logit_bias == {5: 100.0, 7: -100.0}  # keys as ints, clamped to [-100, 100]
    assert sp.allowed_token_ids == (3, 4)
    assert jspec.SamplingParams(temperature=0).uses_processors is False
    assert jspec.SamplingParams(temperature=0, min_p=0.5).uses_processors is False  # greedy ignores min_p
    assert jspec.SamplingParams(repetition_penalty=1.1).uses_processors


@pytest.fixture(scope="module")
def engine_llm(llama_ckpt):
    return jspec.LLM(llama_ckpt[0], max_num_seqs=4, max_model_len=128, page_size=16, max_logprobs=5)


ENGINE_BAD = [
    ({"logit_bias": {VOCAB: 1.0}}, rf"logit_bias has token ids outside the vocabulary \[0, {VOCAB}\)"),
    ({"allowed_token_ids": [1, VOCAB + 3]}, "allowed_token_ids has token ids outside the vocabulary"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids has token ids outside the vocabulary"),
    ({"logprobs": 6}, "logprobs asks for 6 log-probabilities per token, above the engine's max_logprobs=5"),
    ({"logprobs": -1}, "logprobs asks for -1"),
    ({"prompt_logprobs": 9}, "prompt_logprobs asks for 9"),
    ({"stop": ["x"]}, "stop needs a tokenizer"),
    ({"bad_words": ["x"]}, "bad_words needs a tokenizer"),
]


@pytest.mark.parametrize("kwargs, match", ENGINE_BAD, ids=[str(k) for k, _ in ENGINE_BAD])
def test_engine_refuses_and_a_running_request_completes_untouched(engine_llm, kwargs, match):
    eng = engine_llm.engine
    good = random_prompt(np.random.default_rng(4), 30)
    sp = jspec.SamplingParams(max_tokens=10, temperature=0.8, seed=3, repetition_penalty=1.2, logprobs=2,
                              ignore_eos=True)
    expected = engine_llm.generate([good], sp)[0]
    eng.add_request("good", good, sp)
    eng.step()
    eng.step()
    bad = jspec.SamplingParams(max_tokens=5, **kwargs)
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", good, bad)
    with pytest.raises(ValueError, match=match):
        engine_llm.generate([good, good], [sp, bad])  # validated up front: nothing queued
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    assert done.request_id == "good" and done.token_ids == expected.token_ids
    assert [sorted(d) for d in done.outputs[0].logprobs] == [sorted(d) for d in expected.outputs[0].logprobs]
    assert eng.num_free_pages == eng.num_pages
