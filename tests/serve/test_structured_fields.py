"""Structured outputs on the server (issue 27) through the official openai client (in-process
app, the tiny default model): ``response_format`` json_schema and json_object, streamed and
whole; vLLM's ``structured_outputs`` (regex, choice) and ``guided_*`` fields; a bad schema or
regex a 400 naming the field it came in while other requests go on."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.helpers.serve import ENGINE_KWARGS
from tests.helpers.structured import valid

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["color", "n", "tags"], "additionalProperties": False}
# A random model given free whitespace writes whitespace: the tests forbid it (vLLM's option).
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
CHAT = [{"role": "user", "content": "Give me a JSON object"}]
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    import jspec
    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    with TestClient(create_app(llm.engine, "tiny")) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_json_schema_streamed_and_whole(client, T):
    kw = dict(model="tiny", messages=CHAT, max_tokens=60, temperature=T, seed=5, response_format=RF,
              extra_body=COMPACT)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and valid(c.message.content, SCHEMA), c.message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == c.message.content and finish == "stop"


def test_json_object_and_completions(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    c = r.choices[0]
    # any object: the random model may not close it within max_tokens, but what it wrote is an object's start
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=0,
                                  extra_body={"response_format": RF, **COMPACT})
    assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].text, SCHEMA)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "(cat|dog)-[0-9]{2}"}}, lambda t: re.fullmatch("(cat|dog)-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta gamma"]}}, lambda t: t in ("alpha", "beta gamma")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": "[a-z]{3}"}, lambda t: re.fullmatch("[a-z]{3}", t)),
    ({"guided_json": SCHEMA, **COMPACT}, lambda t: valid(t, SCHEMA)),
])
def test_vllm_fields(client, extra, check):
    for stream in (False, True):
        kw = dict(model="tiny", prompt="The answer:", max_tokens=80, temperature=1.0, seed=2, extra_body=extra)
        if stream:
            text = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices)
        else:
            r = client.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].text
        assert check(text), text


@pytest.mark.parametrize("kw, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs", "unclosed group"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: <[99999]>"}}}, "structured_outputs", "Token range"),
    ({"extra_body": {"guided_regex": "[", "guided_choice": ["a"]}}, "guided_choice", "Only one"),
    ({"extra_body": {"structured_outputs": {"disable_any_whitespace": True}}}, "structured_outputs", "no json"),
])
def test_bad_grammar_is_a_400_naming_the_field(client, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, **kw)
    err = e.value.body
    assert err["param"] == param and needle in err["message"], err
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0, response_format=RF,
                                        extra_body=COMPACT)
    assert valid(ok.choices[0].message.content, SCHEMA)
