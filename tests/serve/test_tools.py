"""OpenAI function calling on /v1/chat/completions, the parser-free kinds vLLM has (named and
"required" tool choice, through structured outputs), on the tiny default model through the
official openai client: the reply as tool_calls, whole and streamed, equal to jspec.LLM's
output under the same schema written out here; "none" answers in text; "auto" (on a server
without --enable-auto-tool-choice: tests/serve/test_auto_tools.py has one) and malformed
tools are a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS
from tests.helpers.structured import valid

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
# vLLM's "required" schema: one or more {name, parameters} of any tool (and no other keys)
REQUIRED = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                      "parameters": t["function"]["parameters"]},
     "required": ["name", "parameters"], "additionalProperties": False} for t in TOOLS]}}
MSGS = [{"role": "user", "content": "Weather in Paris for three days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model writes whitespace if let


@pytest.fixture(scope="module")
def setup():
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    ids = llm.get_tokenizer().apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def run(schema, **kw):
        so = None if schema is None else jspec.StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return llm.generate([ids], jspec.SamplingParams(temperature=0, max_tokens=70, structured_outputs=so, **kw))[0]

    # The random model adds array items for as long as it may; a bias on "]" closes the array
    # after the first item (the grammar allows "]" nowhere else).
    close = llm.get_tokenizer().convert_tokens_to_ids("]")
    ref = {"named": run(WEATHER), "required": run(REQUIRED), "closed": run(REQUIRED, logit_bias={close: 100.0}),
           "one": run(REQUIRED | {"maxItems": 1}), "close": close, "none": run(None), "n_prompt": len(ids)}
    with TestClient(create_app(llm.engine, "tiny")) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http), ref


def ask(client, stream=False, **kw):
    kw = {"max_tokens": 70, "temperature": 0, **kw}
    return client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, stream=stream, extra_body=COMPACT,
                                          **kw)


def test_named_tool_call_whole_and_streamed(setup):
    client, ref = setup
    r = ask(client, tool_choice=NAMED)
    c = r.choices[0]
    assert r.usage.prompt_tokens == ref["n_prompt"]  # the tools went through the template as jspec.LLM's did
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert call.function.arguments == ref["named"].text
    assert c.finish_reason == "stop" and valid(call.function.arguments, WEATHER), call.function.arguments
    deltas = [d for chunk in ask(client, stream=True, tool_choice=NAMED) for ch in chunk.choices
              for d in (ch.delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def _streamed_calls(chunks) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each streamed call: its first delta has the id and name,
    every delta of its index a piece of the arguments."""
    calls: dict[int, list] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index][2] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


def _whole_items(text: str) -> tuple[list, str]:
    """The array items of ``text`` written whole, and the text after the last of them (the
    reference: the standard library's JSON decoder, item by item)."""
    dec, items, i = json.JSONDecoder(), [], 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        try:
            item, j = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, text[i:]
        items.append(item)
        i = j


def test_required_tool_calls_whole_and_streamed(setup):
    client, ref = setup
    want = ref["closed"]
    assert want.finish_reason == "stop"
    kw = dict(tool_choice="required", logit_bias={str(ref["close"]): 100})
    c = ask(client, **kw).choices[0]
    items = json.loads(want.text)
    assert c.message.content is None and len(items) >= 1 and c.finish_reason == "tool_calls"  # OpenAI's, vLLM's
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [(i["name"], i["parameters"]) for i in items]
    assert len({t.id for t in c.message.tool_calls}) == len(items)
    chunks = list(ask(client, stream=True, **kw))
    assert [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason] == ["tool_calls"]
    streamed = _streamed_calls(chunks)
    assert [(name, json.loads(args)) for _, name, args in streamed] == [(i["name"], i["parameters"]) for i in items]
    # each call goes out as it is written, not whole at the end (vLLM streams "required" so)
    pieces = [d for chunk in chunks for ch in chunk.choices for d in (ch.delta.tool_calls or [])]
    assert len(pieces) > len(items), pieces


def test_required_cut_by_max_tokens_keeps_whole_calls(setup):
    """An array not closed within max_tokens: its whole calls come back as tool_calls, the
    unfinished rest as content; streamed, the same calls go out as they are written."""
    client, ref = setup
    want = ref["required"]
    assert want.finish_reason == "length"
    items, rest = _whole_items(want.text)
    assert items and rest, want.text  # the random model wrote calls, and max_tokens cut the next one
    c = ask(client, tool_choice="required").choices[0]
    assert c.finish_reason == "length" and c.message.content == rest
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [(i["name"], i["parameters"]) for i in items]
    streamed = _streamed_calls(ask(client, stream=True, tool_choice="required"))
    assert [(name, json.loads(args)) for _, name, args in streamed[:len(items)]] == \
        [(i["name"], i["parameters"]) for i in items]
    assert len(streamed) <= len(items) + 1  # and the cut call's name and arguments so far, if its name was whole


def test_required_cut_before_a_whole_call_stays_text(setup):
    """Cut before its first call is whole: nothing to parse into calls, the text comes back."""
    client, _ = setup
    c = ask(client, tool_choice="required", max_tokens=3).choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content.startswith("[")


def test_required_without_parallel_calls_makes_one(setup):
    """OpenAI's parallel_tool_calls: false holds "required" to exactly one call."""
    client, ref = setup
    want = ref["one"]
    assert want.finish_reason == "stop" and len(json.loads(want.text)) == 1
    c = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    (item,) = json.loads(want.text)
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [(item["name"], item["parameters"])]


def test_tool_choice_none_answers_in_text(setup):
    client, ref = setup
    c = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=70,
                                       temperature=0).choices[0]
    assert c.message.tool_calls is None and c.message.content == ref["none"].text


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS}, "tool_choice"),  # "auto", the default with tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400_naming_the_field(setup, kw, param):
    client, _ = setup
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body
    if kw.get("tool_choice", "auto") == "auto":
        assert "--enable-auto-tool-choice and --tool-call-parser" in e.value.body["message"]


def test_the_tools_reach_the_chat_template():
    """A template that renders the tools (as tool-calling models' do) sees them, as it does
    through transformers' apply_chat_template."""
    from transformers import AutoTokenizer

    from jspec.serve.protocol import ChatMessage
    from jspec.serve.tokenization import chat_prompt_ids
    from tests.helpers.serve import TINY_MODEL

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = ("{% for t in tools or [] %}tool {{ t['function']['name'] }}\n{% endfor %}"
                         "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    msgs = [ChatMessage(**m) for m in MSGS]
    with_tools = chat_prompt_ids(tok, msgs, tools=TOOLS)
    want = tok.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert with_tools == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert len(with_tools) > len(chat_prompt_ids(tok, msgs))
    assert "tool get_time" in tok.decode(with_tools)
