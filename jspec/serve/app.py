"""FastAPI application: the OpenAI-compatible routes over one EngineLoop."""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jspec.sampling_params import SamplingParams, SamplingParamsError
from jspec.serve.engine_loop import EngineLoop
from jspec.serve.metrics import Metrics
from jspec.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    parse_request,
    structured_outputs_of,
)
from jspec.serve.responses import Ctx, complete_response, stream_response

logger = logging.getLogger("jspec.serve")

KNOWN_HANDLERS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                  "/v1/debug/engine"}  # /v1/models/{id} counts as /v1/models


class ServerState:
    def __init__(self, engine, served_model_name: str | None, metrics: Metrics):
        self.engine = engine
        self.model_name = served_model_name or engine.model_name
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics)
        self.draining = False
        self.created = int(time.time())


def create_app(engine, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app over a (synchronous) engine; the engine thread starts with the app's lifespan.
    With ``api_key`` every /v1 route wants ``Authorization: Bearer <api_key>`` (vLLM's
    --api-key); /health and /metrics stay open."""
    name = served_model_name or engine.model_name
    state = ServerState(engine, name, Metrics(name))

    async def lifespan(app):
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="jspec", lifespan=lifespan)
    app.state.jspec = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        state.metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        err = APIError(str(e.detail), e.status_code,
                       code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("unhandled error")
        err = APIError(f"Internal server error: {type(e).__name__}: {e}", 500)
        return JSONResponse(err.body(), status_code=500)

    if api_key:
        app.add_middleware(_RequireKey, key=api_key)
    app.add_middleware(_CountRequests, metrics=state.metrics)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    def model_card():
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jspec",
                "root": getattr(engine, "config", None) and engine.config.model,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(f"The model `{model_id}` does not exist. This server serves `{state.model_name}`.",
                           404, param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/debug/engine")
    async def debug_engine():
        """Engine state as last published by the engine thread (free KV pages etc.)."""
        return dict(state.loop.snapshot, engine_error=state.loop.error)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, chat=True)

    return app


class _RequireKey:
    """Pure ASGI middleware: /v1 routes answer 401 without ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.want):
                err = APIError("Invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                               code="invalid_api_key")
                return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountRequests:
    """Pure ASGI middleware counting requests by handler and status (BaseHTTPMiddleware
    would buffer/interfere with streaming and disconnect detection)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        finally:
            path = scope.get("path", "")
            if path.startswith("/v1/models/"):
                path = "/v1/models"
            self.metrics.http(path if path in KNOWN_HANDLERS else "other", scope.get("method", ""), status)


class _SSEResponse(StreamingResponse):
    """A streaming response that aborts its request however the response ends (disconnect,
    cancellation, or a generator that never started)."""

    def __init__(self, *a, on_close, **kw):
        super().__init__(*a, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ------------------------------------------------------------------------------ requests
def _prompt_ids(state: ServerState, req, chat: bool) -> list[int]:
    eng = state.engine
    if chat:
        tok = eng.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError("This model has no chat template; use /v1/completions", param="messages")
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in msgs:
            if isinstance(m.get("content"), list):  # OpenAI content parts: keep the text ones
                parts = m["content"]
                if any(p.get("type") != "text" for p in parts):
                    raise APIError("Only text content parts are supported", param="messages")
                m["content"] = "".join(p.get("text", "") for p in parts)
        extra = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                 if k not in {"tokenize", "add_generation_prompt", "return_dict", "conversation",
                              "return_tensors", "padding", "truncation"}}
        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt is not False,
                                          tokenize=True, **extra)
        except Exception as e:
            raise APIError(f"Could not apply the chat template: {e}", param="messages") from None
        if hasattr(ids, "keys") and "input_ids" in ids:
            ids = ids["input_ids"]
        return list(ids)
    p = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise APIError("Batched prompts are not supported; send one prompt per request",
                           param="prompt")
        p = p[0]
    if isinstance(p, (str, list)) and len(p) == 0:
        raise APIError("The prompt is empty", param="prompt")
    try:
        return eng.tokenize(p)
    except ValueError as e:
        raise APIError(str(e), param="prompt") from None


def _sampling_params(state: ServerState, req, chat: bool, n_prompt: int) -> SamplingParams:
    max_len = state.engine.max_model_len
    if n_prompt >= max_len:
        raise APIError(f"This model's maximum context length is {max_len} tokens. However, your "
                       f"prompt has {n_prompt} tokens, leaving no room to generate.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    defaults = state.engine.default_sampling  # the model's (generation_config.json)
    if max_tokens is None:
        # OpenAI's defaults: 16 for a completion; a chat completion runs to the context's end.
        max_tokens = max_len - n_prompt if chat else min(16, max_len - n_prompt)
    max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))  # vLLM caps by the model's too
    if max_tokens < 1:
        raise APIError(f"'{param}' must be at least 1, got {max_tokens}", param=param)
    if n_prompt + max_tokens > max_len:
        raise APIError(f"This model's maximum context length is {max_len} tokens. However, you "
                       f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                       f"{max_tokens} in the completion). Please reduce the prompt or '{param}'.",
                       param=param, code="context_length_exceeded")
    V = state.engine.model_cfg.vocab_size
    if req.stop_token_ids and any(not 0 <= t < V for t in req.stop_token_ids):
        raise APIError(f"'stop_token_ids' must be token ids in [0, {V})", param="stop_token_ids")

    def given(k, std=None):  # a field the request leaves out: the model's default, else OpenAI's (vLLM's order)
        return getattr(req, k) if getattr(req, k) is not None else defaults.get(k, std)

    optional = {k: given(k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                      "min_tokens", "bad_words", "allowed_token_ids", "include_stop_str_in_output")}
    kw = dict(max_tokens=max_tokens, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
              top_k=given("top_k", 0), seed=req.seed, ignore_eos=bool(req.ignore_eos),
              stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids else None,
              stop=req.stop or None, n=1 if req.n is None else req.n, logit_bias=req.logit_bias,
              **{k: v for k, v in optional.items() if v is not None})
    so, so_field = structured_outputs_of(req)
    if so is not None:
        kw["structured_outputs"] = so
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        kw["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    else:
        kw["logprobs"] = req.logprobs
        kw["prompt_logprobs"] = req.logprobs if req.echo and req.logprobs is not None else None
    for name, ok, what in (("temperature", kw["temperature"] >= 0, ">= 0"),
                           ("top_p", 0 < kw["top_p"] <= 1, "in (0, 1]"),
                           ("top_k", kw["top_k"] >= -1, "-1, 0 (off) or positive"),
                           ("seed", req.seed is None or 0 <= req.seed < 2**63, "a non-negative integer")):
        if not ok:
            raise APIError(f"'{name}' must be {what}, got {getattr(req, name)}", param=name)
    try:
        return SamplingParams(**kw)
    except SamplingParamsError as e:
        raise APIError(str(e), param=so_field if e.param == "structured_outputs" else _param(e.param, chat)) from None


async def _serve(state: ServerState, request: Request, chat: bool):
    arrival = time.monotonic()
    if state.draining:
        raise APIError("The server is shutting down", 503)
    raw = await request.body()
    req, ignored = parse_request(raw, ChatCompletionRequest if chat else CompletionRequest)
    if ignored:
        logger.warning("ignoring unknown request fields: %s", ", ".join(ignored))
    if req.model is not None and req.model != state.model_name:
        raise APIError(f"The model `{req.model}` does not exist. This server serves "
                       f"`{state.model_name}`.", 404, param="model", code="model_not_found")
    check_unsupported(req)
    ids = _prompt_ids(state, req, chat)
    params = _sampling_params(state, req, chat, len(ids))
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError("'cache_salt' must be a non-empty string", param="cache_salt")
    prompt = ids if req.cache_salt is None else {"prompt_token_ids": ids, "cache_salt": req.cache_salt}
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        stream = await state.loop.add_request(rid, prompt, params, len(ids), arrival)
    except ValueError as e:  # SamplingParamsError names its field
        field = getattr(e, "param", None)
        if field == "structured_outputs":  # the request field the grammar came in
            field = structured_outputs_of(req)[1]
        raise APIError(str(e), param=_param(field, chat)) from None
    prompt_text = None
    if not chat and getattr(req, "echo", False):
        p = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) else req.prompt
        prompt_text = p if isinstance(p, str) else (state.engine.tokenizer.decode(ids) if state.engine.tokenizer else "")
    ctx = Ctx(state, req, chat, rid, ids, params, prompt_text)
    if req.stream:
        return _SSEResponse(stream_response(ctx, stream), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
                            on_close=lambda: None if stream.finished else state.loop.abort(rid))
    return await complete_response(ctx, stream, request)


def _param(field: str | None, chat: bool) -> str:
    """The request field behind a SamplingParams field (chat's logprobs count is top_logprobs)."""
    if field is None:
        return "messages" if chat else "prompt"
    return "top_logprobs" if chat and field == "logprobs" else field
