"""Parsers of a reasoning model's thinking (vLLM's --reasoning-parser): the reply's
``<think>...</think>`` part goes to the message's ``reasoning`` field (current vLLM's name;
older vLLM sent ``reasoning_content``), the rest is its content.

- ``deepseek_r1``: the chat template may put ``<think>`` in the prompt, so a reply is
  reasoning from its start (after a ``<think>`` of its own, if it writes one) to
  ``</think>``; with no ``</think>`` (cut by max_tokens) all of it is reasoning.
- ``qwen3``: the same, and reasoning also ends where a ``<tool_call>`` begins (Qwen3 may
  call a tool without closing its thinking); with ``chat_template_kwargs``
  ``{"enable_thinking": false}`` (the template then writes an empty think block into the
  prompt) the reply is all content.

A reply held to a grammar (structured outputs, a named or "required" tool choice) is
constrained from its first token here, where vLLM constrains what follows the reasoning:
such a reply is reasoning only if it opens with ``<think>`` (a grammar that writes one),
else all content.

- ``openai_gptoss``: gpt-oss's harmony messages (jspec/serve/harmony.py): the bodies of the
  ``analysis`` channel are the reasoning, the others the content (its tool calls, messages
  to ``functions.NAME``, are read by the tool-call parser ``openai``).

``split`` reads a reply as it streams or whole (``final``), as the tool-call parsers do
(jspec/serve/tool_parsers.py): each reading of a longer text extends the one before.
"""

from __future__ import annotations

import dataclasses

from jspec.serve import harmony
from jspec.serve.tool_parsers import tag_overlap

START, END, TOOL_CALL = "<think>", "</think>", "<tool_call>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # the reply is reasoning from its start, <think> written or not
    may_reason: bool  # a <think> the reply opens with starts reasoning
    ends: tuple[str, ...]  # the tags that end reasoning: </think> (dropped), others (kept as content)

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content): None for a part the reply does not have; while streaming,
        the parts sure so far (a tag maybe being written is held back)."""
        if not self.may_reason:
            return None, text
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            begin = lead + len(START)
        elif not final and START.startswith(text[lead:]):
            return None, None  # whitespace or "<thi": a <think> maybe being written
        elif self.starts_in_reasoning:
            begin = 0
        else:
            return None, text
        found = [(i, tag) for tag in self.ends if (i := text.find(tag, begin)) >= 0]
        if found:
            i, tag = min(found)
            return text[begin:i], text[i + len(tag):] if tag == END else text[i:]
        if final:
            return text[begin:], None
        return text[begin:len(text) - max(tag_overlap(text[begin:], tag) for tag in self.ends)], None


@dataclasses.dataclass(frozen=True)
class HarmonyParser:
    """gpt-oss's harmony replies (jspec/serve/harmony.py); ReasoningParser's ``split``."""

    name: str = "openai_gptoss"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        return harmony.split(text, final)


def reasoning_parser(name: str, chat_template_kwargs: dict | None,
                     constrained: bool) -> ReasoningParser | HarmonyParser:
    """The parser ``name`` for one request: its template's ``enable_thinking`` (qwen3),
    and whether a grammar holds its reply (``constrained``)."""
    if name == "openai_gptoss":  # its channels are in the reply, grammar or not
        return HarmonyParser()
    if name == "qwen3":
        thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return ReasoningParser(name, thinking and not constrained, thinking, (END, TOOL_CALL))
    return ReasoningParser(name, not constrained, True, (END,))


REASONING_PARSERS = ("deepseek_r1", "openai_gptoss", "qwen3")
# parsers that read the special tokens of a reply (the server decodes it with them)
KEEPS_SPECIAL_TOKENS = ("openai_gptoss",)
