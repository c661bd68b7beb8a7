"""OpenAI-compatible HTTP server: ``python -m jspec.serve --model PATH``.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (all with
``stream``), GET
/v1/models, /health, /metrics (Prometheus text, vLLM metric names), /v1/debug/engine.

Why FastAPI/Starlette + uvicorn: they are the de-facto Python stack for OpenAI-compatible
servers (vLLM, SGLang, TGI's Python router use them), actively maintained, and give us the
hard parts for free and well-tested: HTTP/1.1 keep-alive and chunked streaming, ASGI
disconnect notification (how an abandoned stream frees its KV pages at once), and
signal-driven graceful shutdown. The engine itself is synchronous and runs on one thread
(engine_loop.EngineLoop); the asyncio side only parses, validates, detokenizes and streams.

Layout: cli.py (arguments, uvicorn), app.py (routes), protocol.py (request models, errors),
engine_loop.py (the engine thread), responses.py (response bodies, SSE), text.py
(incremental detokenizer), tools.py (function calling), tool_parsers.py and reasoning.py
(vLLM's --tool-call-parser and --reasoning-parser, applied by chat_reply.py),
openai_responses.py and openai_responses_output.py (the Responses API over the chat path),
metrics.py.
"""

from jspec.serve.app import create_app

__all__ = ["create_app"]
