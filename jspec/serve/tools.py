"""OpenAI function calling. Named and "required" tool choice need no parser of the model's
tool-call format (vLLM's, the same): the tools go to the chat template; structured outputs
constrain the reply to the named function's parameters, or to a JSON array of {name,
parameters} for "required"; the reply comes back as the message's ``tool_calls``. "auto"
(the default when tools are given) lets the model write calls in its own format, which the
server's --tool-call-parser reads back (jspec/serve/tool_parsers.py); without
--enable-auto-tool-choice it is a 400 naming tool_choice, as on vLLM. "none" leaves the
reply as text.
"""

from __future__ import annotations

import uuid

from jspec.serve.protocol import APIError


def tool_choice(req, auto: bool = False) -> str | None:
    """The chat request's tool choice: None (no tools), "none", "required", "auto" (only
    when the server parses tool calls: ``auto``), or the name of the function it names. A
    400 naming the field for malformed tools or an unknown name."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("parameters", {}), dict):
            raise APIError("each tool must be {'type': 'function', 'function': {'name': str, 'parameters': "
                           "{JSON schema}}}", param="tools")
        names.append(fn["name"])
    if choice is None or choice == "auto":
        if auto:
            return "auto"
        raise APIError('tool_choice "auto" (the default with tools) requires the server to run with '
                       '--enable-auto-tool-choice and --tool-call-parser (hermes or llama3_json); without them '
                       'use "required", a named function ({"type": "function", "function": {"name": ...}}) '
                       'or "none"', param="tool_choice")
    if choice in ("none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or fn.get("name") not in names:
        raise APIError(f"'tool_choice' must be \"none\", \"required\" or {{'type': 'function', 'function': "
                       f"{{'name': one of {names}}}}}, got {choice!r}", param="tool_choice")
    return fn["name"]


def tool_schema(req, choice: str | None) -> dict | None:
    """The JSON schema the reply is held to: the named function's parameters, or for
    "required" an array of one or more {name, parameters} of any tool (vLLM's, with no other
    keys in an item: a model let to add keys may never close the array)."""
    if choice in (None, "none", "auto"):
        return None
    fns = [t["function"] for t in req.tools]
    params = {fn["name"]: fn.get("parameters") or {"type": "object"} for fn in fns}
    if choice != "required":
        return params[choice]
    one = {"maxItems": 1} if getattr(req, "parallel_tool_calls", None) is False else {}
    return {"type": "array", "minItems": 1, **one,
            "items": {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                                  "parameters": p},
                                 "required": ["name", "parameters"], "additionalProperties": False}
                                for name, p in params.items()]}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
