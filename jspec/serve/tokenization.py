"""The prompt's token ids of a chat (shared by /v1/chat/completions and /tokenize), and vLLM's
tokenization routes: ``POST /tokenize`` (a completion prompt or chat messages -> count,
max_model_len, tokens, token_strs) and ``POST /detokenize`` (tokens -> prompt)."""

from __future__ import annotations

import json
import logging

from fastapi import Request

from jspec.serve.protocol import (
    APIError,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_model,
    parse_request,
)

logger = logging.getLogger("jspec.serve")

# apply_chat_template's own arguments, which chat_template_kwargs must not override
_RESERVED = {"tokenize", "add_generation_prompt", "continue_final_message", "return_dict", "conversation",
             "return_tensors", "padding", "truncation", "tools"}


def chat_prompt_ids(tok, messages, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    tools: list | None = None) -> list[int]:
    """The token ids of ``messages`` (ChatMessage models) through the tokenizer's chat
    template, which is given ``tools`` (OpenAI's tool dicts) when there are any;
    ``add_special_tokens`` adds the tokenizer's own (a BOS) on top of the template's."""
    if tok is None or not (getattr(tok, "chat_template", None) or (chat_template_kwargs or {}).get("chat_template")):
        raise APIError("This model has no chat template; use /v1/completions (or send 'chat_template')",
                       param="messages")
    if add_generation_prompt and continue_final_message:
        raise APIError("'continue_final_message' needs 'add_generation_prompt': false", param="continue_final_message")
    msgs = [m.model_dump(exclude_none=True) for m in messages]
    for m in msgs:
        if isinstance(m.get("content"), list):  # OpenAI content parts: keep the text ones
            parts = m["content"]
            if any(p.get("type") != "text" for p in parts):
                raise APIError("Only text content parts are supported", param="messages")
            m["content"] = "".join(p.get("text", "") for p in parts)
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_decoded_arguments(c) for c in m["tool_calls"]]
    extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED}
    kw = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra)
    if tools:
        kw["tools"] = tools
    try:
        if add_special_tokens:
            return list(tok(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=True)["input_ids"])
        ids = tok.apply_chat_template(msgs, tokenize=True, **kw)
    except Exception as e:
        raise _template_error(e) from None
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    return list(ids)


def _template_error(e: Exception) -> APIError:
    """A template that fails on what the request brought (its messages, its own template, a
    raise_exception of the template's) is the client's error, a 400; anything else (jinja2
    missing, a broken install) the server's, a 500 naming the cause, logged."""
    client = (ValueError, TypeError)
    try:
        import jinja2

        client += (jinja2.TemplateError,)
    except ImportError:
        pass
    if isinstance(e, client):
        return APIError(f"Could not apply the chat template: {e}", param="messages")
    logger.error("could not apply the chat template (a server fault)", exc_info=e)
    return APIError(f"The server could not apply the chat template: {type(e).__name__}: {e}", 500)


def _decoded_arguments(call):
    """An assistant message's tool call with its arguments as a mapping: templates index them
    so (vLLM decodes OpenAI's JSON string for them the same way)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        raise APIError("a tool call's 'arguments' must be JSON", param="messages") from None
    return {**call, "function": {**fn, "arguments": args}}


def add_tokenization_routes(app, state) -> None:
    def tokenizer():
        if state.engine.tokenizer is None:
            raise APIError("This model has no tokenizer")
        return state.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None  # parse_request names the problem
        chat = isinstance(body, dict) and "messages" in body
        req, _ = parse_request(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        check_model(req.model, state.model_names)
        tok = tokenizer()
        if chat:
            ids = chat_prompt_ids(tok, req.messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  chat_template_kwargs=req.chat_template_kwargs,
                                  add_special_tokens=req.add_special_tokens, tools=req.tools)
        else:
            ids = state.engine.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req, _ = parse_request(await request.body(), DetokenizeRequest)
        check_model(req.model, state.model_names)
        vocab = state.engine.model_cfg.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token ids {bad[:8]} are not in the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer().decode(req.tokens)}
