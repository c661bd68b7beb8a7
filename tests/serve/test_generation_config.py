"""The model's default sampling parameters (vLLM's ``generation_config``, "auto" by default):
generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens apply where a request (or ``LLM.generate`` without SamplingParams) leaves
them out; a request's own values take precedence; "vllm" ignores them."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS, TINY_MODEL

SP = jspec.SamplingParams
DEFAULTS = dict(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
MAX_NEW = 7
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny model with a generation_config.json that recommends sampling parameters."""
    d = str(tmp_path_factory.mktemp("gen") / "model")
    shutil.copytree(TINY_MODEL, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, **DEFAULTS, "max_new_tokens": MAX_NEW}, f)
    return d


def _kw():
    return {k: v for k, v in ENGINE_KWARGS.items() if k != "model"}


def test_llm_defaults(folder, tmp_path):
    llm = jspec.LLM(folder, **_kw())
    assert llm.get_default_sampling_params() == SP(**DEFAULTS, max_tokens=MAX_NEW)
    out = llm.generate([PROMPT])[0].outputs[0]  # no SamplingParams: the model's, max_tokens 7 (not 16)
    assert len(out.token_ids) == MAX_NEW or out.finish_reason == "stop"
    assert jspec.LLM(folder, generation_config="vllm", **_kw()).get_default_sampling_params() == SP()
    assert jspec.LLM(TINY_MODEL, **_kw()).get_default_sampling_params() == SP()  # no sampling fields: vLLM's
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(os.path.join(folder, "generation_config.json"), elsewhere)
    assert (jspec.LLM(TINY_MODEL, generation_config=str(elsewhere), **_kw()).get_default_sampling_params()
            == SP(**DEFAULTS, max_tokens=MAX_NEW))
    with pytest.raises(ValueError, match=r"generation_config='.*empty': no generation_config.json in that folder"):
        jspec.LLM(TINY_MODEL, generation_config=str(tmp_path / "empty"), **_kw())


def test_server_requests_take_the_model_defaults(folder):
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    llm = jspec.LLM(folder, **_kw())
    ref = {  # on the same engine, before the server's loop owns it
        "default": llm.generate([PROMPT], SP(**DEFAULTS, seed=3, max_tokens=MAX_NEW, ignore_eos=True))[0].outputs[0],
        "greedy": llm.generate([PROMPT], SP(**{**DEFAULTS, "temperature": 0.0}, max_tokens=5,
                                            ignore_eos=True))[0].outputs[0],
        "openai": llm.generate([PROMPT], SP(temperature=1.0, seed=3, max_tokens=MAX_NEW, ignore_eos=True))[0].outputs[0],
    }
    assert ref["default"].token_ids != ref["openai"].token_ids  # the defaults change this output
    with TestClient(create_app(llm.engine, "m")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        extra = {"ignore_eos": True, "return_token_ids": True}
        # No temperature, top_p, top_k, penalty or max_tokens: the model's (16 tokens capped to 7).
        r = client.completions.create(model="m", prompt=PROMPT, seed=3, extra_body=extra)
        assert r.choices[0].model_extra["token_ids"] == ref["default"].token_ids
        assert r.usage.completion_tokens == MAX_NEW
        # The request's own temperature wins; the fields it leaves out are still the model's.
        r = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=5, extra_body=extra)
        assert r.choices[0].model_extra["token_ids"] == ref["greedy"].token_ids
        # A max_tokens above the model's max_new_tokens is capped by it, as in vLLM.
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_NEW


@pytest.mark.parametrize("text, match", [
    ('{"temperature": 0.6,', r"generation_config\.json: not valid JSON"),
    ("[1, 2]", r"generation_config\.json: a JSON object expected, got list"),
    ('{"eos_token_id": "</s>"}', r"generation_config\.json: eos_token_id must be an int or a list of ints, got '</s>'"),
])
def test_a_bad_generation_config_is_named(tmp_path, text, match):
    d = str(tmp_path / "model")
    shutil.copytree(TINY_MODEL, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write(text)
    with pytest.raises(jspec.config.ConfigError, match=match):
        jspec.LLM(d, **_kw())
