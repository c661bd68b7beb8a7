"""One chat choice's reply read by the server's parsers: its reasoning
(jspec/serve/reasoning.py), then in the rest its tool calls (jspec/serve/tool_parsers.py,
tool_choice "auto"), and the content left; whole for a response, or as stream deltas.

``read`` gives a reading of the reply text so far; a stream sends what each reading adds
to the one before (``StreamedReply.delta``), and its last reading is the whole reply's, so
the deltas add up to the message (arguments as the model wrote them, the message's as
json.dumps writes them back, as vLLM). Content beside tool calls that is only whitespace
is no content (None), as OpenAI sends it; a stream holds trailing whitespace back until it
knows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from jspec.serve.reasoning import HarmonyParser, ReasoningParser
from jspec.serve.tool_parsers import READS_WHOLE_REPLY, Call
from jspec.serve.tool_parsers import Reading as ToolReading


@dataclasses.dataclass
class Reading:
    reasoning: str | None
    content: str | None
    calls: list[Call]


@dataclasses.dataclass(frozen=True)
class ReplyParsers:
    """The parsers one request's replies go through."""

    reasoning: ReasoningParser | HarmonyParser | None
    tools: Callable[[str, bool], ToolReading] | None  # a tool_parsers.TOOL_PARSERS function, for "auto"
    one_call: bool = False  # parallel_tool_calls false: the first call only (vLLM drops the others)

    def read(self, text: str, final: bool) -> Reading:
        reasoning, content = self.reasoning.split(text, final) if self.reasoning else (None, text)
        calls: list[Call] = []
        whole = self.tools in READS_WHOLE_REPLY  # harmony's calls: read from their headers
        if self.tools is not None and (content is not None or whole):
            r = self.tools(text if whole else content, final)
            content, calls = r.content, r.calls
            named = any(c.name for c in calls)
            if named or not final:
                # beside calls only text counts; while streaming, trailing whitespace may
                # still turn out to be beside a call (once one is, the text is the reply's)
                content = content if content.strip() else None
                if not final and not named and content is not None:
                    content = content.rstrip()
        if self.reasoning is not None and not content:
            content = None  # vLLM: a reasoning reply's empty content is None
        calls = [c for c in calls if c.name is not None]
        return Reading(reasoning or None, content, calls[:1] if self.one_call else calls)

    def message(self, text: str, new_id) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, OpenAI tool_calls) of the whole reply; ``new_id()`` names each call."""
        r = self.read(text, final=True)
        calls = [{"id": new_id(), "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(json.loads(c.arguments), ensure_ascii=False)}}
                 for c in r.calls]
        return r.reasoning, r.content, calls


class StreamedReply:
    """What one choice's stream has sent of its reply."""

    def __init__(self, parsers: ReplyParsers, new_id):
        self.parsers, self.new_id = parsers, new_id
        self.reasoning = ""
        self.content = ""
        self.calls: dict[int, tuple[int, str]] = {}  # call key -> (its index, arguments sent)

    def delta(self, text: str, final: bool) -> dict:
        """The delta (reasoning / content / tool_calls) from the reply text so far."""
        r = self.parsers.read(text, final)
        d = {}
        for field, now in (("reasoning", r.reasoning), ("content", r.content)):
            sent = getattr(self, field)
            if now and len(now) > len(sent) and now.startswith(sent):
                d[field] = now[len(sent):]
                setattr(self, field, now)
        calls = []
        for c in r.calls:
            if c.key not in self.calls:
                index = len(self.calls)
                self.calls[c.key] = (index, c.arguments)
                calls.append({"index": index, "id": self.new_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
                continue
            index, sent = self.calls[c.key]
            if len(c.arguments) > len(sent) and c.arguments.startswith(sent):
                self.calls[c.key] = (index, c.arguments)
                calls.append({"index": index, "function": {"arguments": c.arguments[len(sent):]}})
        if calls:
            d["tool_calls"] = calls
        return d

    @property
    def called(self) -> bool:
        return bool(self.calls)
