"""OpenAI request bodies (pydantic) and OpenAI-style errors.

Validation policy (documented for clients):

* Bodies are parsed as JSON by us, then validated in pydantic's *strict* JSON mode: a known
  field of the wrong type (``"max_tokens": "5"``, ``"temperature": "hot"``, ``"stream": 1``)
  is a 400 naming the field. Integers are accepted where floats are expected.
* Unknown top-level fields are *ignored* (and logged), as vLLM does: the OpenAI API grows new
  optional fields all the time and clients send them; refusing them would break clients for
  no safety gain.
* Known fields whose non-default values we do not implement (``suffix``, ``best_of``,
  vLLM's ``use_beam_search`` and ``priority``, a ``response_format`` other than text /
  json_object / json_schema, ``tool_choice`` "auto" without --enable-auto-tool-choice) are
  rejected with 400 rather than
  silently ignored: ignoring them would change results. The sampling fields (``n``,
  penalties, ``logit_bias``, ``logprobs`` / ``top_logprobs``, ``echo``, and vLLM's extensions
  ``repetition_penalty``, ``min_p``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``,
  ``include_stop_str_in_output``, ``skip_special_tokens``) map to jspec.SamplingParams, whose
  checks give the 400s; vLLM's prompt fields (``add_special_tokens``,
  ``truncate_prompt_tokens``, ``chat_template``, ``continue_final_message``, ``cache_salt``)
  shape the prompt's token ids.
* Function calling (jspec/serve/tools.py): ``tools`` with ``tool_choice`` "none",
  "required" or a named function; ``parallel_tool_calls``; "auto" on a server with
  --enable-auto-tool-choice --tool-call-parser (jspec/serve/tool_parsers.py). With
  --reasoning-parser, vLLM's ``include_reasoning`` (false: the reasoning is left out).
* Structured outputs: ``response_format`` (``json_object``, ``json_schema``), vLLM's
  ``structured_outputs`` object (json, regex, choice, grammar, json_object,
  disable_any_whitespace) and its older ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar``; at most one of them gives the grammar
  (``structured_outputs``' options, e.g. disable_any_whitespace, apply to any). A bad schema,
  regex or grammar is a 400 naming the field it came in.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error returned to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 type: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _default_type(status)
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1 = disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool | None = False  # vLLM extension
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = False  # vLLM extension: token ids in the response
    cache_salt: str | None = None  # vLLM extension: only requests with the same salt share cached prefixes
    skip_special_tokens: bool | None = None  # vLLM extension: special tokens left out of the text
    add_special_tokens: bool | None = None  # vLLM extension: the tokenizer's own (a BOS) added to the prompt
    truncate_prompt_tokens: int | None = None  # vLLM extension: only the prompt's last k tokens (-1: max_model_len)
    use_beam_search: bool | None = None  # vLLM extension: refused when true
    priority: int | None = None  # vLLM extension: refused when not 0 (no priority scheduling)
    # vLLM extensions (SamplingParams' fields of the same names)
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # Structured outputs (see structured_outputs_of): OpenAI's response_format, vLLM's fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension
    add_generation_prompt: bool | None = True  # vLLM extension
    continue_final_message: bool | None = False  # vLLM extension: the last message is continued, not answered
    chat_template: str | None = None  # vLLM extension: a Jinja template in place of the tokenizer's
    parallel_tool_calls: bool | None = None  # false: "required" makes exactly one tool call
    include_reasoning: bool | None = True  # vLLM extension: false leaves the reasoning parser's reasoning out


class TokenizeCompletionRequest(_Strict):  # vLLM's /tokenize
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):  # vLLM's /tokenize with messages
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(_Strict):  # vLLM's /detokenize
    model: str | None = None
    tokens: list[int]


def check_model(model: str | None, served: list[str]) -> None:
    """404 for a request that names a model other than those served (--served-model-name)."""
    if model is not None and model not in served:
        raise APIError(f"The model `{model}` does not exist. This server serves `{'`, `'.join(served)}`.", 404,
                       param="model", code="model_not_found")


def parse_request(raw: bytes, cls: type[_Strict]) -> tuple[_Strict, list[str]]:
    """Parse and validate a request body; returns (request, ignored unknown field names)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"Malformed JSON in request body: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError("Request body must be a JSON object", code="invalid_json")
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x))
        field = loc.split(".")[0] if loc else None
        got = _short(err.get("input"))
        if err["type"] == "missing":
            msg = f"Missing required field '{loc}'"
        else:
            msg = f"Invalid value for '{loc}': {err['msg']} (got {got})"
        raise APIError(msg, param=field, code="invalid_type" if err["type"] != "missing"
                       else "missing_required_parameter") from None
    ignored = sorted(k for k in obj if k not in cls.model_fields)
    return req, ignored


def _is_union_tag(x) -> bool:
    # pydantic puts the union member's type name into loc ("list[int]", "str", ...)
    return isinstance(x, str) and (x in {"str", "int", "float", "bool"} or "[" in x)


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def check_unsupported(req: _Strict) -> None:
    """400 for known OpenAI fields we do not implement with a non-default value."""
    def bad(param, what):
        raise APIError(f"'{param}' is not supported by this server ({what})", param=param,
                       code="unsupported_parameter")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            bad("suffix", "not implemented")
        if req.best_of not in (None, 1):
            bad("best_of", "only 1")
    if req.use_beam_search:
        bad("use_beam_search", "beam search is not implemented")
    if req.priority:
        bad("priority", "requests are scheduled first come, first served: only 0")
    if req.response_format and req.response_format.get("type") not in (None, "text", "json_object", "json_schema"):
        bad("response_format", "its type must be text, json_object or json_schema")


def structured_outputs_of(req: _Strict, tool: tuple[dict, str] | None = None) -> tuple[dict | None, str | None]:
    """(StructuredOutputsParams' fields, the request field they came from), or (None, None).
    ``tool``: the grammar a forced tool choice gives (jspec/serve/tools.py), and its field."""
    given = [tool] if tool is not None else []
    rf = req.response_format
    if rf and rf.get("type") == "json_object":
        given.append(({"json_object": True}, "response_format"))
    elif rf and rf.get("type") == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise APIError("'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': "
                           "{...}}", param="response_format")
        given.append(({"json": js["schema"]}, "response_format"))
    so = dict(req.structured_outputs or {})
    options = {k: so.pop(k) for k in _OPTIONS if k in so}  # they apply to whichever field gives the grammar
    if req.structured_outputs is not None and (so or not options):
        given.append((so, "structured_outputs"))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            given.append(({key: getattr(req, field)}, field))
    if len(given) > 1:
        raise APIError(f"Only one of {', '.join(f for _, f in given)} may give the output's grammar",
                       param=given[1][1])
    if not given:
        if options:
            raise APIError("'structured_outputs' has options but no json, regex, choice, grammar or json_object",
                           param="structured_outputs")
        return None, None
    return given[0][0] | options, given[0][1]


_OPTIONS = ("disable_any_whitespace",)
