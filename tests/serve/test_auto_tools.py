"""tool_choice "auto" and reasoning on the server started as vLLM serves Qwen3
(--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3), on the tiny
default model through the official openai client: a structured-outputs regex (allowed beside
tools and "auto", as vLLM allows it) makes the random model write a tool call or a think
block, which come back parsed, whole and streamed alike. The parsers' formats in detail:
tests/serve/test_tool_parsers.py."""

from __future__ import annotations

import json
import re

import openai
import pytest

from jspec.serve import cli
from tests.helpers.serve import ENGINE_KWARGS, TINY_MODEL

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def only(text: str) -> dict:
    """A structured-outputs regex whose one match is ``text``."""
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    import jspec
    from jspec.serve.app import create_app

    llm = jspec.LLM(**ENGINE_KWARGS)
    app = create_app(llm.engine, "tiny", enable_auto_tool_choice=True, tool_call_parser="hermes",
                     reasoning_parser="qwen3")
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def ask(client, stream=False, **kw):
    return client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=88, temperature=0, stream=stream,
                                          **kw)


def streamed(chunks):
    """A stream added up as a client does: (role, reasoning, content, calls, finish_reason)."""
    role, reasoning, content, calls, finish, order = None, "", "", {}, None, []
    for chunk in chunks:
        for ch in chunk.choices:
            d = ch.delta
            role = role or d.role
            for field, text in (("reasoning", getattr(d, "reasoning", None)), ("content", d.content)):
                if text:
                    order.append(field)
                    reasoning, content = (reasoning + text, content) if field == "reasoning" else (reasoning,
                                                                                                  content + text)
            for t in d.tool_calls or []:
                order.append("tool_calls")
                if t.id:
                    assert t.index not in calls and t.type == "function"
                    calls[t.index] = [t.function.name, ""]
                calls[t.index][1] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return role, reasoning or None, content or None, [(n, json.loads(a)) for n, a in calls.values()], finish, order


def test_auto_tool_call_after_text(client):
    kw = dict(tools=TOOLS, tool_choice="auto", extra_body=only("Ok.\n" + CALL))
    c = ask(client, **kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Ok.\n"
    (call,) = c.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert c.message.reasoning is None  # the reasoning field is there, empty: no <think> under a grammar
    role, reasoning, content, calls, finish, order = streamed(ask(client, stream=True, **kw))
    assert (role, reasoning, content, finish) == ("assistant", None, "Ok.\n", "tool_calls")
    assert calls == [("get_weather", {"city": "Paris"})] and order[0] == "content" and "tool_calls" in order


def test_tools_without_tool_choice_are_auto(client):
    c = ask(client, tools=TOOLS, extra_body=only(CALL)).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_reasoning_then_content(client):
    kw = dict(extra_body=only("<think>abc</think>answer"))
    c = ask(client, **kw).choices[0]
    assert (c.message.reasoning, c.message.content, c.finish_reason) == ("abc", "answer", "stop")
    _, reasoning, content, calls, finish, order = streamed(ask(client, stream=True, **kw))
    assert (reasoning, content, calls, finish) == ("abc", "answer", [], "stop")
    assert order == sorted(order, key=["reasoning", "content"].index)  # reasoning deltas, then content
    hidden = ask(client, extra_body={**only("<think>abc</think>answer"), "include_reasoning": False}).choices[0]
    assert (hidden.message.reasoning, hidden.message.content) == (None, "answer")


def test_auto_with_a_plain_reply(client):
    """No grammar, thinking off in the template (as Qwen3's enable_thinking): the random text
    is the content, as the same request without tools gets it, whole and streamed."""
    plain = ask(client, extra_body=NO_THINKING).choices[0]
    c = ask(client, tools=TOOLS, extra_body=NO_THINKING).choices[0]
    assert c.message.tool_calls is None and c.message.content == plain.message.content
    assert c.finish_reason == plain.finish_reason and c.message.reasoning is None
    _, reasoning, content, calls, finish, _ = streamed(ask(client, stream=True, tools=TOOLS, extra_body=NO_THINKING))
    assert (reasoning, content, calls, finish) == (None, c.message.content or None, [], c.finish_reason)


@pytest.mark.parametrize("argv, needle", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser (one of hermes, llama3_json, openai)"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice"),
    (["--reasoning-parser", "r1"], "argument --reasoning-parser: invalid choice: 'r1' (choose from"),
])
def test_parser_flags_refused_before_loading(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli.main([TINY_MODEL, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err
    if "--tool-call-parser" in argv:
        assert "'hermes', 'llama3_json'" in err


def test_tool_call_parser_alone_is_accepted():
    """As vLLM: --tool-call-parser without --enable-auto-tool-choice starts (tool_choice
    "auto" stays a 400); create_app checks the names as the command line does."""
    from jspec.serve.app import check_parsers

    check_parsers(False, "llama3_json", "deepseek_r1")
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic' is not one of hermes, llama3_json, openai"):
        check_parsers(True, "pythonic", None)
    with pytest.raises(ValueError, match="--reasoning-parser 'r1' is not one of deepseek_r1, openai_gptoss, qwen3"):
        check_parsers(False, None, "r1")
