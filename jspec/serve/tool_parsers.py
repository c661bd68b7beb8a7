"""Parsers of a model's own tool-call format (vLLM's --tool-call-parser), for tool_choice
"auto": the reply is generated unconstrained, and the calls written in it come back as the
message's ``tool_calls``, the rest as its content.

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / Qwen3): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text may come before,
  between and after calls (vLLM keeps only the text before the first; whitespace between
  or after calls is no content here either).
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the reply is one or more
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) separated by ``;``,
  optionally after ``<|python_tag|>``; text after the last call is content.
- ``openai`` (gpt-oss): harmony messages to ``functions.NAME`` (jspec/serve/harmony.py).

One function per format reads a reply as it streams or whole (``final``): the content so
far and the calls so far, each call keyed by where it starts in the text, its name only
once the call is sure to be one (the name is whole and the arguments object has begun) and
its arguments as the raw text written so far. Each such reading of a longer text extends
the one before, so a stream sends their differences, and the last reading is the whole
reply's: streamed and whole replies agree by construction.

As vLLM: a call whose JSON is malformed, or lacks a string "name" or an object of
arguments, is no call, and its text stays content; the arguments of a call come back as
json.dumps writes them (ensure_ascii off), streamed as the model wrote them. Unlike vLLM (which then gives all the
reply as content), the other calls of the reply still count: a stream cannot take back the
calls it sent before the malformed one. A call the model breaks after its name was streamed
(JSON that turns malformed, a reply cut by max_tokens inside it) still went out in the
stream; the whole reply gives its text as content.
"""

from __future__ import annotations

import dataclasses

from jspec.serve.json_prefix import scan_object


@dataclasses.dataclass
class Call:
    key: int  # where the call starts in the text: the same call in every reading
    name: str | None  # None while the call may still turn out to be none
    arguments: str  # the arguments' JSON text as written so far (whole once the call is)


@dataclasses.dataclass
class Reading:
    content: str  # the text outside the calls that is sure to be content
    calls: list[Call]


def tag_overlap(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag maybe being written)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(s: str, key: int, args_keys: tuple[str, ...], whole: bool) -> Call | None:
    """The call written as the JSON object in ``s`` (nothing else around it but whitespace
    once ``whole``), or None when it is no call. ``args_keys``: the members that may hold
    the arguments, the first present taken (vLLM's order)."""
    sc = scan_object(s)
    if sc.state == "invalid" or (sc.state == "partial" and whole):
        return None
    if sc.state == "complete" and s[sc.end:].strip():
        return None
    name_span = sc.members.get("name")
    args_span = next((sc.members[k] for k in args_keys if k in sc.members), None)
    if name_span is not None and name_span[1] is not None and not isinstance(sc.value(s, "name"), str):
        return None
    if args_span is not None and s[args_span[0]] != "{":  # the arguments must be a JSON object
        return None
    if sc.state == "complete" and (name_span is None or args_span is None):
        return None
    if name_span is None or name_span[1] is None or args_span is None:
        return Call(key, None, "")
    start, end = args_span
    return Call(key, sc.value(s, "name"), s[start:len(s) if end is None else end])


def parse_hermes(text: str, final: bool) -> Reading:
    """``<tool_call>...</tool_call>`` calls (a last one left open at the end of the reply
    counts, as vLLM reads it)."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    content, calls, pos = [], [], 0

    def gap(piece: str):  # whitespace between or after calls is no content (vLLM drops all text there)
        if piece.strip() or not calls:
            content.append(piece)

    while True:
        i = text.find(open_tag, pos)
        if i < 0:
            tail = text[pos:]
            gap(tail if final else tail[:len(tail) - tag_overlap(tail, open_tag)])
            return Reading("".join(content), calls)
        gap(text[pos:i])
        start = i + len(open_tag)
        j = text.find(close_tag, start)
        closed = j >= 0
        # an unclosed body may end in a closing tag being written (or cut by max_tokens)
        body = text[start:j] if closed else text[start:len(text) - tag_overlap(text[start:], close_tag)]
        call = _call(body, i, ("arguments",), whole=closed or final)
        if call is None:
            content.append(text[i:j + len(close_tag)] if closed else text[i:])
        else:
            calls.append(call)
        if not closed:
            return Reading("".join(content), calls)
        pos = j + len(close_tag)


def parse_llama3_json(text: str, final: bool) -> Reading:
    """A reply that is JSON calls (after whitespace and an optional ``<|python_tag|>``),
    separated by ``;`` or whitespace; any other reply is content."""
    tag = "<|python_tag|>"
    i = len(text) - len(text.lstrip())
    if not final and (len(text) - i < len(tag) and tag.startswith(text[i:])):
        return Reading("", [])  # whitespace, or the tag being written: nothing decided yet
    if text.startswith(tag, i):
        i += len(tag)
        i += len(text[i:]) - len(text[i:].lstrip())
    if i == len(text) and not final:
        return Reading("", [])
    if i == len(text) or text[i] != "{":
        return Reading(text, [])
    calls: list[Call] = []
    while True:
        sc = scan_object(text, i)
        if sc.state == "partial" and not final:
            # a call being written: its name once sure, and nothing after it decided yet
            call = _call(text[i:], i, ("arguments", "parameters"), whole=False)
            if call is None:
                return Reading(text if not calls else text[i:], calls)
            return Reading("", calls + [call])
        call = None if sc.state != "complete" else _call(text[i:sc.end], i, ("arguments", "parameters"), whole=True)
        if call is None:
            return Reading(text if not calls else text[i:], calls)
        calls.append(call)
        j = sc.end + len(text[sc.end:]) - len(text[sc.end:].lstrip())
        if j < len(text) and text[j] == ";":
            j += 1
            j += len(text[j:]) - len(text[j:].lstrip())
        if j == len(text):
            return Reading("", calls)
        if text[j] != "{":
            return Reading(text[j:], calls)  # text after the calls: content
        i = j


def parse_required(text: str, final: bool) -> Reading:
    """tool_choice "required": the reply is a JSON array of ``{"name": ..., "parameters":
    {...}}`` (the grammar of jspec/serve/tools.py ``tool_schema`` holds it to that), read as
    it streams, so each call goes out as it is written (vLLM streams these the same way).
    A reply cut by max_tokens keeps its whole calls and the unfinished rest is content (the
    stream sent that call's name and arguments so far, as for a broken "auto" call); cut
    before its first whole call, all of it is content."""
    i = len(text) - len(text.lstrip())
    if i == len(text) or text[i] != "[":
        return Reading(text if final or i < len(text) else "", [])
    calls: list[Call] = []
    i += 1
    while True:
        i += len(text[i:]) - len(text[i:].lstrip())
        if i == len(text):  # a reply cut before any whole call stays text, as it was
            return Reading("" if calls or not final else text, calls)
        if text[i] == "]":  # the array's end (the grammar allows nothing after it)
            return Reading(text[i + 1:].strip(), calls)
        if text[i] == ",":
            i += 1
            continue
        sc = scan_object(text, i)
        whole = sc.state == "complete"
        call = None if sc.state == "invalid" else _call(text[i:sc.end] if whole else text[i:], i, ("parameters",),
                                                         whole=whole or final)
        if call is None:
            return Reading(text[i:] if calls else text, calls)
        calls.append(call)
        if not whole:
            return Reading("", calls)
        i = sc.end


def parse_openai(text: str, final: bool) -> Reading:
    """gpt-oss's harmony tool calls (jspec/serve/harmony.py; imported here at call time: it
    builds on this module's Call and Reading). It reads the whole reply, harmony's headers
    included, not what a reasoning parser leaves (ReplyParsers.read)."""
    from jspec.serve.harmony import parse_openai as parse

    return parse(text, final)


TOOL_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "openai": parse_openai}
READS_WHOLE_REPLY = (parse_openai,)  # the parsers given the reply itself, reasoning and all
