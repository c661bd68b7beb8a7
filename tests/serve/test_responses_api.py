"""OpenAI's Responses API (POST /v1/responses) on the tiny default model through the official
openai client: the reply equals jspec.LLM's greedy output for the chat prompt it amounts to
(instructions a system message first; a template that shows tools, tool calls and tool
results, so the round trip in ``input`` is seen to reach it); streamed events add up to the
whole response; max_output_tokens cuts it "incomplete"; text.format holds it to a schema;
named, "required" and "auto" tool choices give function_call items; the reasoning parser
gives a reasoning item; a stream the client leaves is aborted; bad fields are a 400 naming
the field. The app runs with --enable-auto-tool-choice --tool-call-parser hermes (as vLLM
serves Qwen), one app at a time on one engine (two engine threads stepping one engine hang)."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest

import jspec
from tests.helpers.serve import ENGINE_KWARGS
from tests.helpers.structured import valid

# the tiny model's template, and the tools, tool calls (their arguments indexed as a mapping,
# as tool-calling templates do) and tool results of tool-calling models' templates
# (short: the tiny tokenizer spends a token per byte, and the context is 128)
TEMPLATE = ("{{ bos_token }}{% for t in tools or [] %}{{ t['function']['name'] }};{% endfor %}"
            "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{% for c in m['tool_calls'] or [] %}{{ c['id'] }}:{{ c['function']['name'] }}"
            "({{ c['function']['arguments']['city'] }}){% endfor %}"
            "{% if m['tool_call_id'] %}{{ m['tool_call_id'] }}={% endif %}"
            "{{ m['content'] or '' }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "The forecast", "parameters": WEATHER},
         {"type": "function", "name": "city", "parameters": CITY}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
REQUIRED = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": t["parameters"]},
     "required": ["name", "parameters"], "additionalProperties": False} for t in TOOLS]}}
INSTRUCTIONS, QUESTION = "Be terse.", "Hi?"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model writes whitespace if let
CALL = '<tool_call>\n{"name": "city", "arguments": {"city": "P"}}\n</tool_call>'
ROUND_TRIP = [{"role": "user", "content": QUESTION},
              {"type": "function_call", "call_id": "c1", "name": "city", "arguments": '{"city": "P"}'},
              {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]


@pytest.fixture(scope="module")
def setup():
    """(open_app(**create_app flags) -> openai client, the references); the references are
    generated before any app's engine thread starts."""
    from starlette.testclient import TestClient

    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    tok = llm.get_tokenizer()
    tok.chat_template = TEMPLATE

    def ids(msgs, tools=None):
        out = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def run(prompt, max_tokens, schema=None, **kw):
        so = None if schema is None else jspec.StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return llm.generate([prompt], jspec.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           structured_outputs=so, **kw))[0]

    plain = ids([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    with_tools = ids([{"role": "user", "content": QUESTION}], CHAT_TOOLS)
    close = tok.convert_tokens_to_ids("]")  # closes the "required" array after its first item
    round_trip = [{"role": "user", "content": QUESTION},
                  {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                      "name": "city", "arguments": {"city": "P"}}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ref = {"plain": run(plain, 24), "n_plain": len(plain), "cut": run(plain, 3), "json": run(plain, 70, WEATHER),
           "named": run(with_tools, 70, WEATHER), "required": run(with_tools, 70, REQUIRED, logit_bias={close: 100.0}),
           "close": close, "n_round_trip": len(ids(round_trip, CHAT_TOOLS)),
           "round_trip_text": tok.decode(ids(round_trip, CHAT_TOOLS))}
    current: dict = {}

    def open_app(**flags):
        if current.get("flags") != flags:  # one app (one engine thread) at a time
            if current:
                current["http"].__exit__(None, None, None)
            http = TestClient(create_app(llm.engine, "tiny", **flags))
            http.__enter__()
            current.update(flags=flags, http=http,
                           client=openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http))
        return current["client"]

    yield open_app, ref
    if current:
        current["http"].__exit__(None, None, None)


AUTO = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture
def client(setup):
    return setup[0](**AUTO)


def ask(client, stream=False, **kw):
    kw = {"model": "tiny", "input": QUESTION, "temperature": 0, "max_output_tokens": 70, **kw}
    return client.responses.create(stream=stream, **kw)


def test_text_is_the_chat_reply_with_instructions_first(client, setup):
    ref = setup[1]
    want = ref["plain"]
    r = ask(client, instructions=INSTRUCTIONS, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == want.text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed" and item.id
    assert [(p.type, p.annotations) for p in item.content] == [("output_text", [])]
    assert r.usage.input_tokens == ref["n_plain"]  # the instructions went through the template first
    assert r.usage.output_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert (r.instructions, r.max_output_tokens, r.temperature, r.tool_choice, r.tools) == \
        (INSTRUCTIONS, 24, 0.0, "auto", [])
    assert ask(client, max_output_tokens=24).usage.input_tokens < ref["n_plain"]  # no instructions, no system


def test_max_output_tokens_cuts_it_incomplete(client, setup):
    want = setup[1]["cut"]
    assert want.finish_reason == "length"
    r = ask(client, instructions=INSTRUCTIONS, max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output_text == want.text


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[-1].type == "response.completed"
    return events


def test_streamed_events_add_up_to_the_whole_response(client, setup):
    kw = dict(instructions=INSTRUCTIONS, max_output_tokens=24)
    whole = ask(client, **kw)
    events = _events(ask(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text  # (the stream may coalesce steps)
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {events[2].item.id}
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens and final.output[0].id == events[2].item.id
    # the SDK's stream helper reads the same events into the same response
    with client.responses.stream(model="tiny", input=QUESTION, temperature=0, **kw) as s:
        assert s.get_final_response().output_text == whole.output_text


def test_text_format_json_schema(client, setup):
    want = setup[1]["json"]
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = ask(client, instructions=INSTRUCTIONS, text={"format": fmt}, extra_body=COMPACT)
    assert valid(r.output_text, WEATHER), r.output_text
    assert r.output_text == want.text and r.text.format.type == "json_schema"
    r = ask(client, instructions=INSTRUCTIONS, text={"format": {"type": "json_object"}}, extra_body=COMPACT)
    assert isinstance(json.loads(r.output_text), dict)


def test_named_function_call(client, setup):
    want = setup[1]["named"]
    r = ask(client, tools=TOOLS, tool_choice={"type": "function", "name": "weather"}, extra_body=COMPACT)
    (item,) = r.output
    assert (item.type, item.name, item.status) == ("function_call", "weather", "completed")
    assert item.arguments == want.text and valid(item.arguments, WEATHER)
    assert item.call_id.startswith("call_") and item.id.startswith("fc_") and r.output_text == ""
    events = _events(ask(client, stream=True, tools=TOOLS, tool_choice={"type": "function", "name": "weather"},
                         extra_body=COMPACT))
    assert events[2].type == "response.output_item.added" and events[2].item.name == "weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == item.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == item.arguments and events[-1].response.output[0].arguments == item.arguments


def test_required_function_calls(client, setup):
    ref = setup[1]
    items = json.loads(ref["required"].text)
    kw = dict(tools=TOOLS, tool_choice="required", extra_body={**COMPACT, "logit_bias": {str(ref["close"]): 100}})
    r = ask(client, **kw)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == \
        [("function_call", i["name"], i["parameters"]) for i in items]
    final = _events(ask(client, stream=True, **kw))[-1].response
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == [(i["name"], i["parameters"]) for i in items]


def test_auto_function_call_parsed(client):
    """tool_choice "auto": the hermes parser reads the call the model wrote (a regex makes the
    random model write it, as tests/serve/test_auto_tools.py does)."""
    kw = dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": re.escape("Ok.\n" + CALL)}})
    r = ask(client, max_output_tokens=80, **kw)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Ok.\n" and r.output[1].name == "city"
    assert json.loads(r.output[1].arguments) == {"city": "P"} and r.status == "completed"
    events = _events(ask(client, stream=True, max_output_tokens=80, **kw))
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Ok.\n"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "P"} and final.output[1].arguments == args


def test_function_call_round_trip_reaches_the_template(client, setup):
    ref = setup[1]
    assert "c1:city(P)" in ref["round_trip_text"] and "c1=sunny" in ref["round_trip_text"]
    r = ask(client, input=ROUND_TRIP, tools=TOOLS, tool_choice="none", max_output_tokens=1)
    assert r.usage.input_tokens == ref["n_round_trip"]
    # a reasoning item passed back is dropped; an assistant message is a message
    back = ROUND_TRIP + [{"type": "reasoning", "id": "rs_1", "summary": []},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]}]
    assert ask(client, input=back, tools=TOOLS, tool_choice="none", max_output_tokens=1).usage.input_tokens > \
        ref["n_round_trip"]


def test_reasoning_item(setup):
    """--reasoning-parser qwen3: the thinking is a reasoning item before the message."""
    client = setup[0](reasoning_parser="qwen3")
    kw = dict(extra_body={"structured_outputs": {"regex": re.escape("<think>abc</think>answer")}},
              reasoning={"effort": "low"})
    r = ask(client, **kw)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "answer"
    assert [(c.type, c.text) for c in r.output[0].content] == [("reasoning_text", "abc")]
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.reasoning.effort == "low"
    events = _events(ask(client, stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "abc"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "answer"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_a_stream_the_client_leaves_is_aborted(client):
    from tests.serve.test_prompt_arrays import _finished

    http = client._client
    before = _finished(http, "abort")
    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 80, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and "output_text.delta" in line:
                break  # leave mid-stream
    eng = http.app.state.jspec.engine
    deadline = time.monotonic() + 10
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished_requests() and _finished(http, "abort") == before + 1


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),  # past max_model_len: the chat path's error, renamed
    ({"temperature": "hot"}, "temperature"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"input": "x" * 2000}, "input"),  # a prompt longer than the context
])
def test_bad_fields_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "tiny", "input": QUESTION, "max_output_tokens": 4, **kw})
    assert e.value.body["param"] == param, e.value.body
    assert "Traceback" not in e.value.body["message"]


def test_auto_without_a_tool_call_parser_is_a_400(setup):
    client = setup[0]()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=QUESTION, tools=TOOLS, max_output_tokens=4)
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
