"""FastAPI application: the OpenAI-compatible routes over one EngineLoop."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jspec import __version__
from jspec.sampling_params import SamplingParams, SamplingParamsError
from jspec.serve.chat_reply import ReplyParsers
from jspec.serve.engine_loop import EngineLoop
from jspec.serve.metrics import Metrics, StatLogger
from jspec.serve.openai_responses import ResponsesRequest, chat_request, responses_error
from jspec.serve.openai_responses_output import new_id, respond
from jspec.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    check_unsupported,
    parse_request,
    structured_outputs_of,
)
from jspec.serve.reasoning import KEEPS_SPECIAL_TOKENS, REASONING_PARSERS, reasoning_parser
from jspec.serve.responses import Ctx, SSEResponse, complete_response, stream_response
from jspec.serve.tokenization import add_tokenization_routes, chat_prompt_ids
from jspec.serve.tool_parsers import READS_WHOLE_REPLY, TOOL_PARSERS, parse_required
from jspec.serve.tools import tool_choice, tool_schema

logger = logging.getLogger("jspec.serve")

KNOWN_HANDLERS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
                  "/v1/debug/engine", "/tokenize", "/detokenize", "/ping", "/version"}  # /v1/models/{id} counts as /v1/models


class ServerState:
    def __init__(self, engine, served_model_name: str | list[str] | None, log_stats_interval: float | None = None):
        self.engine = engine
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        # requests may name any of them; responses and metrics carry the first (vLLM's)
        self.model_names = names or [engine.model_name]
        self.model_name = self.model_names[0]
        self.metrics = Metrics(self.model_name)
        stats = None
        if log_stats_interval is not None:
            stats = StatLogger(log_stats_interval, speculating=bool(getattr(engine, "K", 0)), kv_label=_kv_label())
        self.loop = EngineLoop(engine, self.metrics, stat_logger=stats)
        self.draining = False
        self.created = int(time.time())
        self.prompt_tokens_details = False  # usage reports the prompt tokens the prefix cache served
        self.tool_parser = None  # the tool-call parser that serves tool_choice "auto", if it is served
        self.reasoning_parser: str | None = None  # the reasoning parser's name, if replies are parsed for it


def _kv_label() -> str:
    """The KV cache's name in the stats line: vLLM's "GPU KV cache usage" on a GPU."""
    import jax

    backend = jax.default_backend()
    return "KV cache usage" if backend == "cpu" else f"{backend.upper()} KV cache usage"


def check_parsers(enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """vLLM's rules for its parser flags: a ValueError naming the flag and its choices."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")


@dataclasses.dataclass(frozen=True)
class HTTPOptions:
    """The app's HTTP setup from vLLM's flags: CORS (every origin, method and header by
    default, as vLLM) and the API docs pages (TLS and --root-path are uvicorn's)."""

    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    docs: bool = True


def create_app(engine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
               enable_prompt_tokens_details: bool = False, enable_auto_tool_choice: bool = False,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               http: HTTPOptions | None = None, log_stats_interval: float | None = None) -> FastAPI:
    """The app over a (synchronous) engine; the engine thread starts with the app's lifespan.
    With ``api_key`` every /v1 route wants ``Authorization: Bearer <api_key>`` (vLLM's
    --api-key); /health and /metrics stay open. ``enable_prompt_tokens_details``: usage
    carries prompt_tokens_details.cached_tokens (vLLM's flag). ``enable_auto_tool_choice``
    with ``tool_call_parser`` serves tool_choice "auto" (jspec/serve/tool_parsers.py);
    ``reasoning_parser`` puts a reasoning model's thinking in the message's ``reasoning``
    (jspec/serve/reasoning.py): vLLM's flags of the same names. ``http``: CORS and the rest
    of the HTTP setup (HTTPOptions' defaults: vLLM's). ``log_stats_interval``: seconds between
    the throughput lines logged while there is work (metrics.StatLogger; None: none)."""
    check_parsers(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    http = http or HTTPOptions()
    state = ServerState(engine, served_model_name, log_stats_interval)
    state.prompt_tokens_details = enable_prompt_tokens_details
    state.tool_parser = TOOL_PARSERS[tool_call_parser] if enable_auto_tool_choice else None
    state.reasoning_parser = reasoning_parser

    async def lifespan(app):
        state.loop.start()
        yield
        state.loop.stop()

    docs = {} if http.docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="jspec", lifespan=lifespan, **docs)
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
    # outermost: a browser's preflight is answered before the key is asked for, and a 401
    # carries the CORS headers the browser needs to show it
    app.add_middleware(CORSMiddleware, allow_origins=http.allowed_origins, allow_methods=http.allowed_methods,
                       allow_headers=http.allowed_headers, allow_credentials=http.allow_credentials)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    # SageMaker's health check, which vLLM serves as /health
    app.add_api_route("/ping", health, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", health, methods=["POST"], operation_id="ping_post")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def model_card(name: str):
        return {"id": name, "object": "model", "created": state.created, "owned_by": "jspec",
                "root": getattr(engine, "config", None) and engine.config.model,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in state.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, state.model_names)
        return model_card(model_id)

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

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, run as the chat request it amounts to."""
        arrival = time.monotonic()
        req = await read_request(state, request, ResponsesRequest)
        try:
            sub = await submit(state, chat_request(req), True, arrival, rid=new_id("resp"))
        except APIError as e:
            raise responses_error(e) from None
        return await respond(req, sub, request)

    add_tokenization_routes(app, state)
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


# ------------------------------------------------------------------------------ requests
def _prompt_ids(state: ServerState, req, chat: bool, tool: str | None) -> list[list[int]]:
    """The token ids of each prompt: a chat's one (the tools, if any, given to its template),
    or a completion's (a string or token ids, or a batch of either: OpenAI's prompt arrays)."""
    eng = state.engine
    k = req.truncate_prompt_tokens  # vLLM's: only the last k tokens of each prompt
    if k is not None and not (k == -1 or k >= 1):
        raise APIError(f"'truncate_prompt_tokens' must be -1 (max_model_len) or >= 1, got {k}",
                       param="truncate_prompt_tokens")
    k = eng.max_model_len if k == -1 else k
    if chat:
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.chat_template is not None:
            template_kwargs["chat_template"] = req.chat_template
        ids = chat_prompt_ids(eng.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt is not False,
                              continue_final_message=bool(req.continue_final_message),
                              chat_template_kwargs=template_kwargs, add_special_tokens=bool(req.add_special_tokens),
                              tools=req.tools if tool is not None else None)
        return [ids[-k:] if k else ids]
    p = req.prompt
    batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    out = []
    for one in batch:
        if isinstance(one, (str, list)) and len(one) == 0:
            raise APIError("The prompt is empty", param="prompt")
        try:
            ids = eng.tokenize(one, add_special_tokens=req.add_special_tokens is not False)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None
        out.append(ids[-k:] if k else ids)
    return out


def _grammar_sources(req, tool: str | None):
    """structured_outputs_of with a forced tool choice's grammar counted among the sources."""
    schema = tool_schema(req, tool)
    return structured_outputs_of(req, None if schema is None else ({"json": schema}, "tool_choice"))


def _sampling_params(state: ServerState, req, chat: bool, n_prompt: int, tool: str | None) -> SamplingParams:
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
    if req.skip_special_tokens is not None:
        optional["skip_special_tokens"] = req.skip_special_tokens
    elif chat and (state.reasoning_parser in KEEPS_SPECIAL_TOKENS or state.tool_parser in READS_WHOLE_REPLY):
        # harmony's channels are special tokens
        optional["skip_special_tokens"] = False
    kw = dict(max_tokens=max_tokens, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
              top_k=given("top_k", 0), seed=req.seed, ignore_eos=bool(req.ignore_eos),
              stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids else None,
              stop=req.stop or None, n=1 if req.n is None else req.n, logit_bias=req.logit_bias,
              **{k: v for k, v in optional.items() if v is not None})
    so, so_field = _grammar_sources(req, tool)
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


async def read_request(state: ServerState, request: Request, cls):
    """The request body as ``cls`` (a 503 while the server drains); unknown fields are logged."""
    if state.draining:
        raise APIError("The server is shutting down", 503)
    req, ignored = parse_request(await request.body(), cls)
    if ignored:
        logger.warning("ignoring unknown request fields: %s", ", ".join(ignored))
    return req


async def _serve(state: ServerState, request: Request, chat: bool):
    arrival = time.monotonic()
    req = await read_request(state, request, ChatCompletionRequest if chat else CompletionRequest)
    sub = await submit(state, req, chat, arrival)
    if req.stream:
        return SSEResponse(stream_response(sub.ctxs, sub.streams), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Request-Id": sub.rid},
                           on_close=lambda: sub.abort_unfinished(state))
    return await complete_response(sub.ctxs, sub.streams, request)


@dataclasses.dataclass
class Submitted:
    """A request the engine took: its id, one Ctx and stream per prompt, their sampling params."""

    rid: str
    ctxs: list[Ctx]
    streams: list
    params: list[SamplingParams]

    def abort_unfinished(self, state: ServerState) -> None:
        for c, s in zip(self.ctxs, self.streams):
            if not s.finished:
                state.loop.abort(c.rid)


async def submit(state: ServerState, req, chat: bool, arrival: float, rid: str | None = None) -> Submitted:
    """Validate a (chat) completion request, build its prompts and sampling params, and queue
    it on the engine: shared by /v1/completions, /v1/chat/completions and /v1/responses
    (which reads its request into a chat request). ``rid``: the response id (default: the
    route's own prefix)."""
    check_model(req.model, state.model_names)
    check_unsupported(req)
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError("'cache_salt' must be a non-empty string", param="cache_salt")
    tool = tool_choice(req, auto=state.tool_parser is not None) if chat else None
    prompts = _prompt_ids(state, req, chat, tool)
    params = [_sampling_params(state, req, chat, len(ids), tool) for ids in prompts]
    rid = rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    # A batch of prompts runs as one engine request each; choice i * n + j is prompt i's j-th (as vLLM).
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    salt = {} if req.cache_salt is None else {"cache_salt": req.cache_salt}
    # All queued at once (one engine step admits them together), all aborted if one is refused.
    added = await asyncio.gather(*(state.loop.add_request(r, {"prompt_token_ids": ids, **salt}, sp, len(ids), arrival)
                                   for r, ids, sp in zip(rids, prompts, params)), return_exceptions=True)
    streams = [a for a in added if not isinstance(a, BaseException)]
    if len(streams) < len(added):
        for r, a in zip(rids, added):
            if not isinstance(a, BaseException):
                state.loop.abort(r)
        e = next(a for a in added if isinstance(a, BaseException))
        if not isinstance(e, ValueError):
            raise e
        field = getattr(e, "param", None)  # SamplingParamsError names its field
        if field == "structured_outputs":  # the request field the grammar came in
            field = _grammar_sources(req, tool)[1]
        raise APIError(str(e), param=_param(field, chat)) from None
    texts = [None] * len(prompts)
    if not chat and getattr(req, "echo", False):
        p = req.prompt
        given = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        tok = state.engine.tokenizer
        texts = [p if isinstance(p, str) else (tok.decode(ids) if tok else "") for p, ids in zip(given, prompts)]
    n = params[0].n
    parsers = _reply_parsers(state, req, tool, params[0]) if chat else None
    ctxs = [Ctx(state, req, chat, r, ids, sp, text, index_base=i * n, response_id=rid, tool=tool, parsers=parsers)
            for i, (r, ids, sp, text) in enumerate(zip(rids, prompts, params, texts))]
    return Submitted(rid, ctxs, streams, params)


def _reply_parsers(state: ServerState, req, tool: str | None, params: SamplingParams) -> ReplyParsers | None:
    """The parsers a chat reply goes through: reasoning (unless a named or "required" tool
    choice holds the reply to its JSON), then tool calls: the server's parser for
    tool_choice "auto", the JSON array of "required"."""
    reasoning = None
    if state.reasoning_parser is not None and tool in (None, "none", "auto"):
        reasoning = reasoning_parser(state.reasoning_parser, req.chat_template_kwargs,
                                     constrained=params.structured_outputs is not None)
    tools = {"auto": state.tool_parser, "required": parse_required}.get(tool)
    if reasoning is None and tools is None:
        return None
    return ReplyParsers(reasoning, tools, one_call=getattr(req, "parallel_tool_calls", None) is False)


def _param(field: str | None, chat: bool) -> str:
    """The request field behind a SamplingParams field (chat's logprobs count is top_logprobs)."""
    if field is None:
        return "messages" if chat else "prompt"
    return "top_logprobs" if chat and field == "logprobs" else field
