"""The server's reply parsers on hand-written replies in their models' documented formats
(no engine): tool calls (hermes, llama3_json), reasoning (qwen3, deepseek_r1, gpt-oss's
harmony channels), the JSON
prefix scan under them; each reply streamed in random splits adds up to its whole reading
(vLLM's --tool-call-parser / --reasoning-parser semantics, jspec/serve/tool_parsers.py)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from jspec.serve.chat_reply import ReplyParsers, StreamedReply
from jspec.serve.json_prefix import scan_object
from jspec.serve.reasoning import reasoning_parser
from jspec.serve.tool_parsers import TOOL_PARSERS, parse_required

_ids = itertools.count()


def new_id():
    return f"call-{next(_ids)}"


HERMES = ReplyParsers(None, TOOL_PARSERS["hermes"])
LLAMA = ReplyParsers(None, TOOL_PARSERS["llama3_json"])


def whole(parsers, text):
    """The whole reply's (reasoning, content, [(name, arguments parsed)])."""
    reasoning, content, calls = parsers.message(text, new_id)
    assert all(c["type"] == "function" and c["id"].startswith("call-") for c in calls)
    return reasoning, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(parsers, text, rng):
    """The same reply streamed in random splits, its deltas added up as a client does."""
    s = StreamedReply(parsers, new_id)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)))) + [len(text)]
    reasoning, content, calls = "", "", {}
    for k in cuts:
        d = s.delta(text[:k], k == len(text))
        reasoning += d.get("reasoning", "")
        content += d.get("content", "")
        for t in d.get("tool_calls", []):
            if t["index"] not in calls:  # the call's first delta: id, type, name
                assert t["index"] == len(calls) and t["id"] and t["type"] == "function", t
                calls[t["index"]] = [t["function"]["name"], ""]
            else:
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}, t
            calls[t["index"]][1] += t["function"]["arguments"]
    return reasoning or None, content or None, [(n, json.loads(a)) for n, a in calls.values()]


def check(parsers, text, want, splits=60):
    assert whole(parsers, text) == want
    rng = random.Random(text)
    for _ in range(splits):
        got = streamed(parsers, text, rng)
        # whole: None for no content beside calls; a stream sends none
        assert got == (want[0], want[1] or None, want[2]), got


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
PARIS = ("get_weather", {"city": "Paris", "days": 3})


@pytest.mark.parametrize("text, want", [
    (CALL, (None, None, [PARIS])),
    ("Let me look that up.\n" + CALL, (None, "Let me look that up.\n", [PARIS])),
    (CALL + "\n" + CALL.replace("Paris", "Oslo\\u00e9") + "\n", (None, None, [PARIS, ("get_weather", {"city": "Osloé", "days": 3})])),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": ["UTC", {"x": -1.5e2}], "ok": true, "n": null}}</tool_call>',
     (None, None, [("get_time", {"tz": ["UTC", {"x": -150.0}], "ok": True, "n": None})])),
    ('<tool_call>\n{"arguments": {}, "name": "ping"}', (None, None, [("ping", {})])),  # unclosed at the end, keys swapped
    ("A plain answer, no tags < > {json: 1}.", (None, "A plain answer, no tags < > {json: 1}.", [])),
    (CALL + "\nDone.", (None, "\nDone.", [PARIS])),
    ("", (None, "", [])),
])
def test_hermes(text, want):
    check(HERMES, text, want)


@pytest.mark.parametrize("bad", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',  # arguments must be an object
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments (vLLM: KeyError, the text stays content)
    '<tool_call>{"name": "f", "oops": {]}, "arguments": {}}</tool_call>',
    '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
    "<tool_call>\n",  # cut by max_tokens before the call began
])
def test_hermes_malformed_call_stays_content(bad):
    """As vLLM: malformed JSON inside the tags is no call, and the reply is all content."""
    check(HERMES, "Hi. " + bad, (None, "Hi. " + bad, []))
    # a well-formed call beside it still counts (vLLM would give all as content): streamed the same
    check(HERMES, CALL + bad, (None, bad, [PARIS]))


@pytest.mark.parametrize("bad, args", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', {"a": 1}),  # the outer object left open
    ('<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', {}),
])
def test_hermes_call_broken_after_its_name(bad, args):
    """JSON that breaks after the call's name and arguments began: the whole reply gives it
    as content (vLLM's); the stream had sent the call by then and cannot take it back (as
    vLLM's stream), so it ends with the text as content too (unless one delta brought it
    all: then nothing was sent early)."""
    assert whole(HERMES, bad) == (None, bad, [])
    sent = [streamed(HERMES, bad, random.Random(seed)) for seed in range(20)]
    assert all(got in ((None, bad, [("f", args)]), (None, bad, [])) for got in sent), sent
    assert (None, bad, [("f", args)]) in sent


@pytest.mark.parametrize("text, want", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', (None, None, [PARIS])),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', (None, None, [PARIS])),
    ('\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}; {"name": "get_time", "parameters": {}}',
     (None, None, [PARIS, ("get_time", {})])),
    ('{"name": "a", "parameters": {"x": "}{;"}};{"name": "b", "parameters": {"y": [1]}}\n',
     (None, None, [("a", {"x": "}{;"}), ("b", {"y": [1]})])),
    ('{"name": "get_time", "parameters": {}} I called it.', (None, "I called it.", [("get_time", {})])),
    ("The answer is 4.", (None, "The answer is 4.", [])),
    ('{"answer": 4}', (None, '{"answer": 4}', [])),  # JSON that is no call
    ('{"name": "f", "parameters": {"a": 1', (None, '{"name": "f", "parameters": {"a": 1', [])),  # cut by max_tokens
    ('{"name": "f", ', (None, '{"name": "f", ', [])),  # cut before the call was sure
    ("<|python_tag|>print(1)", (None, "<|python_tag|>print(1)", [])),
])
def test_llama3_json(text, want):
    check(LLAMA, text, want, splits=0 if text.endswith("1") else 60)  # a cut call's stream had sent it


REQUIRED = ReplyParsers(None, parse_required)


@pytest.mark.parametrize("text, want", [
    ('[{"name":"get_weather","parameters":{"city":"Paris","days":3}}]', (None, None, [PARIS])),
    ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"parameters": {}, "name": "t"}]',
     (None, None, [PARIS, ("t", {})])),
    ('[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"t","par',  # cut by max_tokens
     (None, '{"name":"t","par', [PARIS])),
    ('[{"name":"get_weather","parameters":{"city":"Paris","days":3}},', (None, None, [PARIS])),
    ('[{"name":"t","parameters":{"a":', (None, '[{"name":"t","parameters":{"a":', [])),  # no whole call: text
    ("[", (None, "[", [])),
])
def test_required(text, want):
    """tool_choice "required"'s JSON array: each call streamed as it is written."""
    cut_in_call = text.endswith(("par", ":"))  # the stream sent the cut call's name (or will not: random splits)
    assert whole(REQUIRED, text) == want
    rng = random.Random(text)
    for _ in range(0 if cut_in_call else 60):
        assert streamed(REQUIRED, text, rng) == (want[0], want[1] or None, want[2])


QWEN3 = ReplyParsers(reasoning_parser("qwen3", None, constrained=False), None)
QWEN3_TOOLS = ReplyParsers(reasoning_parser("qwen3", None, constrained=False), TOOL_PARSERS["hermes"])
R1 = ReplyParsers(reasoning_parser("deepseek_r1", None, constrained=False), None)


@pytest.mark.parametrize("parsers, text, want", [
    (QWEN3, "<think>\nThe user greets.\n</think>\n\nHello!", ("\nThe user greets.\n", "\n\nHello!", [])),
    (QWEN3, "The user greets.\n</think>\n\nHello!", ("The user greets.\n", "\n\nHello!", [])),  # <think> in the prompt
    (QWEN3, "<think>\nStill thinking when max_tokens hit", ("\nStill thinking when max_tokens hit", None, [])),
    (QWEN3, "<think>abc</think>", ("abc", None, [])),
    (QWEN3_TOOLS, "<think>\nI need the weather.\n</think>\n\n" + CALL, ("\nI need the weather.\n", None, [PARIS])),
    (QWEN3_TOOLS, "<think>I need the weather. " + CALL, ("I need the weather. ", None, [PARIS])),  # <tool_call> ends it
    (QWEN3_TOOLS, "<think>x</think>\n\nIt is sunny.", ("x", "\n\nIt is sunny.", [])),
    (R1, "<think>a < b</think>So a.", ("a < b", "So a.", [])),
    (R1, "Reasoning whose <think> was in the prompt</think>Answer", ("Reasoning whose <think> was in the prompt",
                                                                     "Answer", [])),
    (R1, "No end tag", ("No end tag", None, [])),
])
def test_reasoning(parsers, text, want):
    check(parsers, text, want)


HARMONY = ReplyParsers(reasoning_parser("openai_gptoss", None, constrained=False), None)


@pytest.mark.parametrize("text, want", [
    ("<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
     ("User greets.", "Hello!", [])),
    ("<|channel|>analysis<|message|>a < b <|x|><|end|><|start|>assistant<|channel|>final<|message|>So a.<|return|>",
     ("a < b <|x|>", "So a.", [])),
    ("<|channel|>analysis<|message|>Still thinking when max_tokens hit", ("Still thinking when max_tokens hit", None, [])),
    ("<|channel|>final<|message|>Just the answer.", (None, "Just the answer.", [])),
    ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|> two<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done", ("one two", "Done", [])),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     (None, "Checking.Sunny.", [])),
    ("Plain text, no harmony.", (None, "Plain text, no harmony.", [])),
])
def test_harmony_channels(text, want):
    """gpt-oss (--reasoning-parser openai_gptoss): the analysis channel is the reasoning, the
    final channel the content; the harmony tags are in neither."""
    check(HARMONY, text, want)


HARMONY_TOOLS = ReplyParsers(reasoning_parser("openai_gptoss", None, constrained=False), TOOL_PARSERS["openai"])
WEATHER = '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("text, want", [
    # the recipient after the channel, with <|constrain|>, as gpt-oss writes a call
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>", ("Need weather.", None, [PARIS])),
    # the recipient in the role part; two calls; a preamble on commentary to no one is content
    ("<|channel|>commentary<|message|>Checking two cities.<|end|><|start|>assistant to=functions.get_weather"
     f"<|channel|>commentary json<|message|>{WEATHER}<|call|><|start|>assistant to=functions.get_weather"
     "<|channel|>commentary json<|message|>{\"city\": \"Oslo\", \"days\": 3}<|call|>",
     (None, "Checking two cities.", [PARIS, ("get_weather", {"city": "Oslo", "days": 3})])),
    # the first header's recipient right after the prompt's <|start|>assistant
    (f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>", (None, None, [PARIS])),
    # a final answer, no call
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
     ("Easy.", "4", [])),
    # a call whose body is no JSON object: its body is content
    ("<|channel|>commentary to=functions.get_weather<|message|>Paris please<|call|>", (None, "Paris please", [])),
])
def test_harmony_tool_calls(text, want):
    """gpt-oss (--tool-call-parser openai with --reasoning-parser openai_gptoss): messages to
    functions.NAME are calls, whole and streamed; analysis the reasoning, the rest content."""
    check(HARMONY_TOOLS, text, want)


def test_reasoning_off_and_under_a_grammar():
    """qwen3 with enable_thinking false: all content; a reply held to a grammar is reasoning
    only when it opens with <think>."""
    off = ReplyParsers(reasoning_parser("qwen3", {"enable_thinking": False}, constrained=False), None)
    check(off, "<think>x</think>Hello", (None, "<think>x</think>Hello", []))
    for name in ("qwen3", "deepseek_r1"):
        held = ReplyParsers(reasoning_parser(name, {"enable_thinking": True}, constrained=True), None)
        check(held, '{"a": 1}', (None, '{"a": 1}', []))
        check(held, "<think>abc</think>answer", ("abc", "answer", []))


def test_json_prefix_scan():
    doc = '{"name": "f", "arguments": {"s": "a\\"b\\u00e9\\n", "n": [0, -1.5e-3, 12], "t": true, "z": null}}'
    for k in range(len(doc)):  # every prefix may still become the object
        assert scan_object(doc[:k]).state == "partial", doc[:k]
    sc = scan_object(doc + " trailing")
    assert sc.state == "complete" and sc.end == len(doc) and sc.value(doc, "name") == "f"
    assert json.loads(doc[slice(*sc.members["arguments"])]) == json.loads(doc)["arguments"]
    for bad in ['{"a": 01}', '{"a": tru}', '{a: 1}', '{"a" 1}', '{"a": 1,}', '{"a": "x\ny"}', '{"a": NaN}',
                '{"a": 1.}', '{"a": .5}', '[1]', '{"a": "\\x"}', '{"a": -}', '{"a": 1 2}']:
        assert scan_object(bad).state == "invalid", bad


def test_parallel_tool_calls_false_keeps_the_first_call():
    one = ReplyParsers(None, TOOL_PARSERS["hermes"], one_call=True)
    check(one, CALL + "\n" + CALL.replace("Paris", "Oslo"), (None, None, [PARIS]))
