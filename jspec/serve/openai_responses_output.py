"""The Responses API's answer (``POST /v1/responses``) to a request run through the chat path
(jspec/serve/openai_responses.py): one response object, whole or as server-sent events, in
the shapes vLLM sends for models without harmony (vllm/entrypoints/openai/responses/:
protocol.py ``ResponsesResponse.from_request``, simple_streaming_events.py) and the openai
SDK parses (openai/types/responses/).

Output items, in the order vLLM gives them: a ``reasoning`` item (the reasoning parser's
thinking, as ``content`` [reasoning_text], ``summary`` empty), a ``message`` item
(output_text), then one ``function_call`` item per tool call. A reply cut by
max_output_tokens is ``status`` "incomplete" with ``incomplete_details.reason``
"max_output_tokens".

Streamed: response.created and response.in_progress, then per item output_item.added,
(content_part.added, output_text.delta / reasoning_text.delta ..., their .done,
content_part.done) or function_call_arguments.delta ... .done, output_item.done, and
response.completed with the whole response; every event has its ``sequence_number``. The
deltas are those of the chat stream (``Ctx.chat_delta``), so they add up to the whole reply.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jspec.serve.protocol import APIError
from jspec.serve.responses import Ctx, SSEResponse, next_updates, run_to_end
from jspec.serve.tools import new_call_id


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed", "content": [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(ctx: Ctx, text: str) -> list[dict]:
    """The output items of a whole reply ``text``."""
    if ctx.tool is not None:  # a named function: the reply is its arguments
        return [call_item(new_id("fc"), new_id("call"), ctx.tool, text)]
    if ctx.parsers is None:
        return [message_item(new_id("msg"), text)] if text else []
    thought, content, calls = ctx.parsers.message(text, new_call_id)
    items = [reasoning_item(new_id("rs"), thought)] if thought else []
    if content:
        items.append(message_item(new_id("msg"), content))
    return items + [call_item(new_id("fc"), new_id("call"), c["function"]["name"], c["function"]["arguments"])
                    for c in calls]


class ResponseBody:
    """The response object's fields the request fixes (OpenAI echoes them; the SDK's
    ``Response`` requires some), and its usage."""

    def __init__(self, req, ctx: Ctx, params, response_id: str):
        self.req, self.ctx, self.id = req, ctx, response_id
        self.created_at = int(time.time())
        self.echo = {
            "instructions": req.instructions, "metadata": req.metadata, "model": ctx.state.model_name,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": params.temperature,
            "top_p": params.top_p, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "max_output_tokens": params.max_tokens, "previous_response_id": None, "reasoning": req.reasoning,
            "text": req.text or {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
            "user": req.user, "background": False, "service_tier": req.service_tier or "auto",
            "max_tool_calls": req.max_tool_calls, "top_logprobs": req.top_logprobs, "error": None}

    def usage(self, output: list[dict]) -> dict:
        ctx = self.ctx
        n_in, n_out = len(ctx.prompt_ids), len(ctx.token_ids)
        # the thinking's tokens, as its text tokenizes (the reply's own ids are not split by item)
        thought = "".join(p["text"] for it in output if it["type"] == "reasoning" for p in it["content"])
        n_reasoning = min(n_out, len(ctx.tokenizer.encode(thought, add_special_tokens=False))) if thought else 0
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": ctx.num_cached_tokens},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": n_reasoning},
                "total_tokens": n_in + n_out}

    def body(self, output: list[dict], finished: bool = True) -> dict:
        cut = finished and self.ctx.choices[0].finish_reason == "length"
        status = "in_progress" if not finished else "incomplete" if cut else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": output,
                "usage": self.usage(output) if finished else None, **self.echo}


async def respond(req, sub, request: Request):
    """The whole response, or its event stream (``req.stream``), of the submitted request."""
    (ctx,), (stream,) = sub.ctxs, sub.streams
    rb = ResponseBody(req, ctx, sub.params[0], sub.rid)
    if req.stream:
        return SSEResponse(_events(rb, stream), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Request-Id": sub.rid},
                           on_close=lambda: sub.abort_unfinished(ctx.state))
    if await run_to_end(sub.ctxs, sub.streams, request) is None:
        return Response(status_code=499)  # the client went away: nobody reads the answer
    return JSONResponse(rb.body(output_items(ctx, ctx.choices[0].detok.sent)))


class _EventStream:
    """Turns the chat stream's deltas into the Responses API's events: one item open at a
    time; a delta of another kind closes it and opens the next."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []  # the output so far, finished items whole
        self.open: dict | None = None  # the open item (its events so far) and its text

    def event(self, type_: str, **fields) -> str:
        data = json.dumps({"type": type_, "sequence_number": self.seq, **fields}, ensure_ascii=False)
        self.seq += 1
        return f"event: {type_}\ndata: {data}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _start(self, kind: str, item: dict) -> list[str]:
        out = self.close()
        self.open = {"kind": kind, "id": item["id"], "text": "", "item": item}
        out.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
            out.append(self.event("response.content_part.added", content_index=0, part=part, **self._where()))
        return out

    def text(self, kind: str, delta: str) -> list[str]:
        """Reasoning or message text."""
        out = []
        if self.open is None or self.open["kind"] != kind:
            item = ({"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"}
                    if kind == "reasoning" else
                    {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                     "content": []})
            out = self._start(kind, item)
        self.open["text"] += delta
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", content_index=0, delta=delta, **self._where()))
        else:
            out.append(self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=[],
                                  **self._where()))
        return out

    def call(self, d: dict) -> list[str]:
        """A chat tool-call delta: a new call (id and name) or more of the open one's arguments
        (calls are written one after another, so more arguments are always the open call's)."""
        out, args = [], d.get("function", {}).get("arguments") or ""
        if "id" in d:
            out = self._start("function_call", call_item(new_id("fc"), new_id("call"), d["function"]["name"], "",
                                                         "in_progress"))
        if args:
            self.open["text"] += args
            out.append(self.event("response.function_call_arguments.delta", delta=args, **self._where()))
        return out

    def close(self) -> list[str]:
        """The open item's done events; it joins the output."""
        if self.open is None:
            return []
        o, where, out = self.open, self._where(), []
        if o["kind"] == "function_call":
            item = {**o["item"], "arguments": o["text"], "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", arguments=o["text"], name=item["name"],
                                  **where))
        else:
            reasoning = o["kind"] == "reasoning"
            part = {"type": "reasoning_text", "text": o["text"]} if reasoning else text_part(o["text"])
            item = reasoning_item(o["id"], o["text"]) if reasoning else message_item(o["id"], o["text"])
            out.append(self.event("response.reasoning_text.done" if reasoning else "response.output_text.done",
                                  content_index=0, text=o["text"], **({} if reasoning else {"logprobs": []}),
                                  **where))
            out.append(self.event("response.content_part.done", content_index=0, part=part, **where))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        self.open = None
        return out

    def delta(self, d: dict) -> list[str]:
        out = []
        for kind in ("reasoning", "content"):
            if d.get(kind):
                out += self.text("reasoning" if kind == "reasoning" else "message", d[kind])
        for call in d.get("tool_calls") or []:
            out += self.call(call)
        return out


async def _events(rb: ResponseBody, stream):
    ctx, es = rb.ctx, _EventStream()
    try:
        yield es.event("response.created", response=rb.body([], finished=False))
        yield es.event("response.in_progress", response=rb.body([], finished=False))
        while not stream.finished:
            try:
                updates = await next_updates(ctx, stream)
            except APIError as e:
                yield es.event("error", code=e.code or e.type, message=e.message, param=e.param)
                return
            for c, text, new_ids, _, fin in updates:
                if text or fin or new_ids:
                    for ev in es.delta(ctx.chat_delta(c, text, fin)):
                        yield ev
        for ev in es.close():
            yield ev
        yield es.event("response.completed", response=rb.body(es.items))
    finally:
        if not stream.finished:  # the client went away (or the server is cancelling us)
            ctx.state.loop.abort(ctx.rid)
