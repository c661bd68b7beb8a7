"""OpenAI's Responses API request (``POST /v1/responses``), read into the chat completion
request it amounts to, so that it runs through exactly the chat path (template, tools,
sampling params, structured outputs, the server's parsers) as vLLM serves it for models
without harmony (vllm/entrypoints/openai/responses/: protocol.py ``ResponsesRequest``,
utils.py's input messages):

- ``instructions`` is a system message before ``input``; ``input`` is a string (one user
  message) or a list of items: messages (role user / system / developer / assistant, content a
  string or input_text / output_text parts), ``function_call`` (an assistant message's
  tool call; a run of them is one message) and ``function_call_output`` (a tool message);
  ``reasoning`` items a client passes back are dropped (the template is given no earlier
  thinking, as chat clients send none).
- ``tools`` are flat (``{"type": "function", "name", "description", "parameters"}``) and
  ``tool_choice`` names a function as ``{"type": "function", "name"}``: both become chat's.
- ``text.format`` (text / json_object / json_schema) is chat's ``response_format``;
  ``max_output_tokens`` its ``max_completion_tokens``; ``reasoning.effort`` goes to the
  template as ``reasoning_effort`` (vLLM's, for templates that read it);
  ``truncation`` "auto" keeps the prompt's last max_model_len tokens (vLLM's).
- ``store`` is accepted and nothing is stored (vLLM without VLLM_ENABLE_RESPONSES_API_STORE
  does the same, silently); so ``previous_response_id`` and ``background`` (which needs a
  store) are a 400 naming the field, as are ``prompt`` (vLLM's too) and ``include`` (no
  logprobs or encrypted reasoning here). ``metadata``, ``user``, ``service_tier``,
  ``max_tool_calls`` are echoed.

Errors the chat path raises name the Responses field (``input`` for ``messages`` ...).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from jspec.serve.protocol import APIError, ChatCompletionRequest, _Strict


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = True  # OpenAI's default; nothing is stored here (as vLLM by default)
    previous_response_id: str | None = None
    background: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extensions of its ResponsesRequest (chat's fields of the same names)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    structured_outputs: dict[str, Any] | None = None


# chat request fields -> the Responses field they come from (for the errors the chat path raises)
_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
           "truncate_prompt_tokens": "truncation", "chat_template_kwargs": "reasoning"}
_PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "top_k", "seed", "stop", "ignore_eos",
           "repetition_penalty", "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "cache_salt",
           "priority", "structured_outputs", "user")


def responses_error(e: APIError) -> APIError:
    """An error of the chat path with the Responses field it concerns named instead."""
    field = _FIELDS.get(e.param)
    if field is None:
        return e
    return APIError(e.message.replace(f"'{e.param}'", f"'{field}'"), e.status, param=field, type=e.type, code=e.code)


def _bad(param: str, what: str) -> APIError:
    return APIError(f"'{param}' is not supported by this server ({what})", param=param, code="unsupported_parameter")


def check_responses_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise _bad("previous_response_id", "responses are not stored; send the conversation in 'input'")
    if req.background:
        raise _bad("background", "it needs a store of responses, which this server does not keep")
    if req.prompt is not None:
        raise _bad("prompt", "prompt templates are not implemented")
    if req.include:
        raise _bad("include", "no logprobs or encrypted reasoning are returned")
    if req.truncation not in (None, "disabled", "auto"):
        raise APIError(f"'truncation' must be \"auto\" or \"disabled\", got {req.truncation!r}", param="truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(f"'max_output_tokens' must be at least 1, got {req.max_output_tokens}",
                       param="max_output_tokens")


def _text(content, where: str) -> str:
    """The text of an item's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str) for p in content):
        raise APIError(f"{where} must be a string or a list of input_text / output_text parts (only text is "
                       "supported)", param="input")
    return "".join(p["text"] for p in content)


def _str_field(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(f"{where} needs '{key}' (a string)", param="input")
    return item[key]


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of ``instructions`` and ``input``."""
    msgs = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    if not req.input:
        raise APIError("'input' is empty", param="input")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param="input")
            # chat templates know "system", rarely OpenAI's newer "developer" (the same role)
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise APIError(f"{where} has type {kind!r}; supported: message, function_call, function_call_output, "
                           "reasoning", param="input")
    return msgs


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Chat's ``tools`` and ``tool_choice`` for the request's flat function tools."""
    tools = None
    if req.tools:
        tools = []
        for t in req.tools:
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise APIError("each tool must be {'type': 'function', 'name': str, 'parameters': {JSON schema}} "
                               "(no built-in tools)", param="tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                            "strict") if t.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{'type': 'function', "
                           f"'name': ...}}, got {choice!r}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif not tools and choice in ("auto", "none"):
        choice = None  # OpenAI's default "auto" with no tools: nothing to choose
    return tools, choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError("'text.format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                   "'name': ..., 'schema': {...}}", param="text")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request ``req`` amounts to."""
    check_responses_unsupported(req)
    tools, choice = chat_tools(req)
    body = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    body.update(messages=chat_messages(req), tools=tools, tool_choice=choice,
                max_completion_tokens=req.max_output_tokens, response_format=_response_format(req.text))
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    if req.truncation == "auto":
        body["truncate_prompt_tokens"] = -1
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps(body))
    except ValidationError as e:  # a field the Responses model lets through loosely (e.g. a message's content)
        err = e.errors(include_url=False)[0]
        field = _FIELDS.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else None
        raise APIError(f"Invalid value for '{field}': {err['msg']}", param=field) from None
