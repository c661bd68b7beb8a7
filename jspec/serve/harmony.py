"""gpt-oss's harmony replies, read as messages: the reasoning parser ``openai_gptoss``
(jspec/serve/reasoning.py) and the tool-call parser ``openai`` (jspec/serve/tool_parsers.py)
both read them here.

A reply (decoded with its special tokens, which the server keeps for these parsers) is
messages, the first one's header right after the prompt's ``<|start|>assistant``, each
other's after a ``<|start|>`` of its own:

    [ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY END

END is ``<|end|>``, ``<|return|>`` (the reply's last) or ``<|call|>`` (a tool call's).
``analysis`` is the reasoning; a message to ``functions.NAME`` (on ``commentary``) calls
tool NAME with its body, a JSON object, as the arguments; other messages (``final``, and
``commentary`` to no one) are the content. Text before any header (a model not writing
harmony) is content.

As the other parsers, ``messages`` reads a reply as it streams or whole (``final``): while
streaming, a tag maybe being written is held back, so each reading of a longer text extends
the one before.
"""

from __future__ import annotations

import dataclasses
import re

from jspec.serve.json_prefix import scan_object
from jspec.serve.tool_parsers import Call, Reading, tag_overlap

START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                       "<|return|>", "<|call|>", "<|constrain|>")
TAGS = (START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclasses.dataclass
class Message:
    key: int  # where its header starts in the reply: the same message in every reading
    channel: str
    recipient: str | None  # "functions.get_weather" for a tool call
    body: str  # so far, while streaming
    closed: bool  # its END written


def messages(text: str, final: bool) -> tuple[str, list[Message]]:
    """(the text before any harmony header, the messages whose headers are whole)."""
    if not final:
        text = text[:len(text) - max(tag_overlap(text, tag) for tag in TAGS)]
    first = min((i for i in (text.find(CHANNEL), text.find(START)) if i >= 0), default=-1)
    if first < 0:  # no header yet; " to=functions.x" before a first <|channel|> is a header being written
        t = text.lstrip()
        return ("", []) if not final and ("to=".startswith(t) or re.fullmatch(r"to=[^\s<]*", t)) else (text, [])
    lead, pos = text[:first], first
    if _RECIPIENT.fullmatch(lead.strip()):  # the first header's recipient, in its role part
        lead, pos = "", 0
    out: list[Message] = []
    while pos < len(text):
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:  # a header still being written
            break
        header = text[pos:head_end]
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = re.split(r"[\s<]", channel, maxsplit=1)[0]
        to = _RECIPIENT.search(header)
        body = head_end + len(MESSAGE)
        ends = [i for tag in (END, RETURN, CALL) if (i := text.find(tag, body)) >= 0]
        stop = min(ends) if ends else len(text)
        out.append(Message(pos, channel, to.group(1) if to else None, text[body:stop], bool(ends)))
        nxt = text.find(START, stop)
        pos = len(text) if nxt < 0 else nxt + len(START)
    return (lead if lead.strip() else ""), out


def split(text: str, final: bool) -> tuple[str | None, str | None]:
    """(reasoning, content): the analysis bodies, the other bodies (tool calls included: no
    tool parser reads them here); None for a part the reply does not have."""
    lead, msgs = messages(text, final)
    reasoning = [m.body for m in msgs if m.channel == "analysis"]
    content = ([lead] if lead else []) + [m.body for m in msgs if m.channel != "analysis"]
    return ("".join(reasoning) if reasoning else None), ("".join(content) if content else None)


def parse_openai(text: str, final: bool) -> Reading:
    """The tool-call parser ``openai`` (vLLM's name for gpt-oss's; tool_parsers.TOOL_PARSERS):
    each message to ``functions.NAME`` a call, named once its body has begun as a JSON
    object, its arguments the body so far; the content the bodies of messages neither analysis (the
    reasoning parser's) nor calls. A closed call whose body is not one JSON object is no
    call: its body is content, as the other parsers keep a malformed call's text."""
    lead, msgs = messages(text, final)
    content, calls = [lead] if lead else [], []
    for m in msgs:
        if m.recipient is None or not m.recipient.startswith("functions."):
            if m.channel != "analysis":
                content.append(m.body)
            continue
        whole = m.closed or final
        body = m.body.strip() if whole else m.body.lstrip()
        if not body and not whole:  # its body not begun: a call or not, nothing decided yet
            continue
        sc = scan_object(body)
        if (sc.state == "complete" and not body[sc.end:].strip()) if whole else sc.state != "invalid":
            calls.append(Call(m.key, m.recipient[len("functions."):], body))
        else:
            content.append(m.body)
    return Reading("".join(content), calls)
