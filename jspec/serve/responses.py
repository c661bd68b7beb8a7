"""OpenAI response bodies of one request: its ``n`` choices (one per sample) for each of its
prompts (a completion's prompt array runs as one engine request per prompt, one ``Ctx``
each; choice i * n + j is prompt i's j-th sample, as vLLM numbers them), streamed as SSE
chunks or returned whole, with ``logprobs`` in OpenAI's shapes (completions: tokens /
token_logprobs / top_logprobs / text_offset; chat: content[{token, logprob, bytes,
top_logprobs}]) and ``echo`` (completions: the prompt, and its logprobs, first).

A chat choice's reply goes through the server's parsers when it has them
(jspec/serve/chat_reply.py): reasoning, and tool calls for tool_choice "auto", whole in the
message or as delta messages of ``reasoning`` / ``content`` / ``tool_calls``.

Stop strings end a request in the engine (SamplingParams.stop, min_tokens respected), which
also cuts the final text; here each choice holds back the last len(longest stop) - 1
characters while it streams, so text that a stop string will cut is never sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jspec.engine.outputs import sum_metrics
from jspec.serve.chat_reply import ReplyParsers, StreamedReply
from jspec.serve.engine_loop import RequestStream
from jspec.serve.protocol import APIError
from jspec.serve.text import Detokenizer
from jspec.serve.tools import new_call_id

logger = logging.getLogger("jspec.serve")


class SSEResponse(StreamingResponse):
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


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else x  # JSON has no -inf (vLLM's clamp)


class Choice:
    """One sample's state as it streams."""

    def __init__(self, index: int, tokenizer, hold: int, skip_special_tokens: bool = True):
        self.index = index
        self.detok = Detokenizer(tokenizer, hold=hold, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.n_lp = 0  # logprob entries already sent
        self.offset = 0  # text offset of the next token (completions' text_offset)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM)
        self.prompt_ids_sent = False  # return_token_ids: a completion choice's prompt ids go out once
        self.tool_call_id = new_call_id()  # its tool call's id, when a tool choice names the function
        self.tool_started = False  # a named tool call's id and name went out (streaming)
        self.reply: StreamedReply | None = None  # what its stream sent, when parsers read the reply
        self.tools_called = False  # its reply made "required" or "auto" tool calls: finish_reason "tool_calls"


class Ctx:
    """One prompt's engine request (``rid``) and its choices, numbered from ``index_base``,
    in a response whose id is ``response_id``."""

    def __init__(self, state, req, chat, rid, prompt_ids, params, prompt_text: str | None, index_base: int = 0,
                 response_id: str | None = None, tool: str | None = None, parsers: ReplyParsers | None = None):
        self.state, self.req, self.chat, self.rid = state, req, chat, rid
        # a function's name: the reply is its arguments ("required", "auto": the parsers find the calls)
        self.tool = tool if tool not in ("none", "auto", "required") else None
        self.parsers = parsers  # reasoning and tool-call parsers a chat reply goes through
        # the message has a "reasoning" field (None when there is none), as vLLM's with a reasoning parser
        self.reasoning_field = chat and state.reasoning_parser is not None
        self.include_reasoning = getattr(req, "include_reasoning", None) is not False  # vLLM's request field
        self.response_id = response_id or rid
        self.prompt_ids = prompt_ids
        tok = state.engine.tokenizer
        self.tokenizer = tok
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self.choices = [Choice(index_base + i, tok, hold, params.skip_special_tokens) for i in range(params.n)]
        if parsers is not None:
            for c in self.choices:
                c.reply = StreamedReply(parsers, new_call_id)
        self.created = int(time.time())
        self.logprobs = params.logprobs  # top-N per token, or None
        self.echo = bool(getattr(req, "echo", False)) and not chat
        self.prompt_text = prompt_text
        self.prompt_logprobs = None  # the engine's, when echo asks for them
        self.spec_metrics: dict | None = None  # the request's speculative counters, when speculating
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    def usage(self):
        n = sum(len(c.token_ids) for c in self.choices)
        u = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n, "total_tokens": len(self.prompt_ids) + n}
        if self.state.prompt_tokens_details:
            u["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        if self.spec_metrics is not None:
            # jspec's extension (OpenAI clients keep unknown usage fields): this request's
            # drafts, accepted tokens, acceptance per draft position and mean acceptance length.
            u["speculative_decoding"] = self.spec_metrics
        return u

    def chunk(self, choices, usage=None):
        d = {"id": self.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.created, "model": self.state.model_name, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return "data: " + json.dumps(d, ensure_ascii=False) + "\n\n"

    # -- logprobs in OpenAI's shapes --------------------------------------------------
    def _tok(self, tid: int, lp) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)

    def logprobs_obj(self, c: Choice, ids: list[int], entries: list, prompt: bool = False):
        """The logprobs of ``ids`` (their engine dicts ``entries``; None: a first prompt token)."""
        if self.logprobs is None:
            return None
        if self.chat:
            content = []
            for t, d in zip(ids, entries):
                s = self._tok(t, d[t])
                top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[: self.logprobs]
                content.append({"token": s, "logprob": _lp(d[t].logprob), "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self._tok(i, v), "logprob": _lp(v.logprob),
                                                  "bytes": list(self._tok(i, v).encode())} for i, v in top]})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, d in zip(ids, entries):
            s = self._tok(t, None if d is None else d[t])
            out["tokens"].append(s)
            out["token_logprobs"].append(None if d is None else _lp(d[t].logprob))
            out["top_logprobs"].append(None if d is None else {self._tok(i, v): _lp(v.logprob) for i, v in d.items()})
            out["text_offset"].append(c.offset)
            c.offset += len(s)
        return out

    def echo_prefix(self, c: Choice):
        """(text, logprobs) of the prompt that ``echo`` puts first."""
        lp = None
        if self.logprobs is not None:
            lp = self.logprobs_obj(c, self.prompt_ids, list(self.prompt_logprobs or [None] * len(self.prompt_ids)))
        return self.prompt_text or "", lp

    def role_delta(self) -> dict:
        return {"role": "assistant", "content": "" if self.tool is None else None}

    def chat_delta(self, c: Choice, text: str, finished: bool) -> dict:
        """A chat choice's delta message for its new ``text``: content, or what the tool
        choice or the parsers make of the reply so far."""
        if self.tool is not None:
            return self._tool_delta(c, text, finished)
        if c.reply is not None:
            delta = c.reply.delta(c.detok.sent, finished)
            c.tools_called = c.reply.called
            if not self.include_reasoning:
                delta.pop("reasoning", None)
            return delta
        return {"content": text} if text else {}

    def finish_reason(self, c: Choice) -> str | None:
        """OpenAI's: "tool_calls" for a reply that stopped after "required" or "auto" calls."""
        return "tool_calls" if c.finish_reason == "stop" and c.tools_called else c.finish_reason

    def choice_delta(self, c: Choice, delta, finish_reason, token_ids=None, logprobs=None):
        """A streamed choice: ``delta`` is a chat choice's delta message, a completion's text."""
        stop_reason = c.stop_reason if finish_reason else None
        if self.chat:
            d = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                 "stop_reason": stop_reason}
        else:
            d = {"index": c.index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                 "stop_reason": stop_reason}
            if self.req.return_token_ids and not c.prompt_ids_sent:
                d["prompt_token_ids"], c.prompt_ids_sent = self.prompt_ids, True
        if self.req.return_token_ids and token_ids is not None:
            d["token_ids"] = token_ids
        return d

    def _tool_delta(self, c: Choice, text: str, finished: bool) -> dict:
        """A streamed named tool call: its arguments as they come (its id and name first)."""
        if not text and c.tool_started:
            return {}
        call = {"index": 0, "function": {"arguments": text}}
        if not c.tool_started:
            call = {"index": 0, "id": c.tool_call_id, "type": "function",
                    "function": {"name": self.tool, "arguments": text}}
            c.tool_started = True
        return {"tool_calls": [call]}

    def message(self, c: Choice, text: str) -> dict:
        reasoning = {"reasoning": None} if self.reasoning_field else {}
        if self.tool is not None:  # a named call finishes with "stop" (OpenAI's, vLLM's)
            call = {"id": c.tool_call_id, "type": "function", "function": {"name": self.tool, "arguments": text}}
            return {"role": "assistant", "content": None, **reasoning, "tool_calls": [call]}
        if self.parsers is None:
            return {"role": "assistant", "content": text, **reasoning}
        thought, content, calls = self.parsers.message(text, new_call_id)
        if self.reasoning_field:
            reasoning["reasoning"] = thought if self.include_reasoning else None
        m = {"role": "assistant", "content": content, **reasoning}
        if calls:
            m["tool_calls"], c.tools_called = calls, True
        return m


def batch_usage(ctxs: list[Ctx]) -> dict:
    """The usage of a response over all its prompts (their speculative counters summed)."""
    if len(ctxs) == 1:
        return ctxs[0].usage()
    us = [c.usage() for c in ctxs]
    out = {k: sum(u[k] for u in us) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if "prompt_tokens_details" in us[0]:
        out["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in us)}
    spec = [u["speculative_decoding"] for u in us if "speculative_decoding" in u]
    if spec:
        out["speculative_decoding"] = sum_metrics(spec)
    return out


def _merge_lp(a, b):
    """Completions logprobs of two consecutive spans as one."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


async def next_updates(ctx: Ctx, stream: RequestStream):
    """The next output of the request: per choice (choice, new text, new token ids, new
    logprob entries, just finished)."""
    out = await stream.get()
    if out.error:
        raise APIError(out.error, 500)
    if ctx.state.engine.spec is not None and out.metrics:
        ctx.spec_metrics = out.metrics  # the engine loop's copy, made on the engine thread
    if out.prompt_logprobs is not None:
        ctx.prompt_logprobs = out.prompt_logprobs
    if out.num_cached_tokens is not None:
        ctx.num_cached_tokens = out.num_cached_tokens
    updates = []
    for i, c in enumerate(ctx.choices):
        if c.finish_reason is not None:
            continue
        o = out.outputs[i] if out.outputs else None
        ids = list(o.token_ids) if o is not None else c.token_ids
        fin = (o.finish_reason if o is not None else None) or (out.finish_reason if out.finished else None)
        new_ids = ids[len(c.token_ids):]
        c.token_ids = ids
        delta = c.detok.update(ids, fin is not None, o.text if o is not None and fin is not None else None)
        lps = []
        if o is not None and o.logprobs is not None:
            lps, c.n_lp = o.logprobs[c.n_lp:], len(o.logprobs)
        c.finish_reason = fin
        if fin is not None and o is not None:
            c.stop_reason = o.stop_reason
        updates.append((c, delta, new_ids, lps, fin is not None))
    if out.finished:
        stream.finished = True
    return updates


async def _merged(gens):
    """The items of several async generators as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(g):
        try:
            async for x in g:
                await queue.put(x)
        except Exception as e:  # handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(end)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        ended = 0
        while ended < len(tasks):
            x = await queue.get()
            if x is end:
                ended += 1
            elif isinstance(x, Exception):
                raise x
            else:
                yield x
    finally:
        for t in tasks:
            t.cancel()


async def _prompt_chunks(ctx: Ctx, stream: RequestStream, continuous: bool):
    """One prompt's chunks: its choices' first deltas, then each update until it finishes."""
    try:
        for c in ctx.choices:
            if ctx.chat:
                yield ctx.chunk([ctx.choice_delta(c, ctx.role_delta(), None)])
            elif ctx.echo:
                text, lp = ctx.echo_prefix(c)
                yield ctx.chunk([ctx.choice_delta(c, text, None, logprobs=lp)])
        while not stream.finished:
            try:
                updates = await next_updates(ctx, stream)
            except APIError as e:
                yield "data: " + json.dumps(e.body()) + "\n\n"
                break
            for c, delta, new_ids, lps, fin in updates:
                if delta or fin or new_ids:
                    lp = ctx.logprobs_obj(c, new_ids, lps) if lps else None
                    if ctx.chat:
                        delta = ctx.chat_delta(c, delta, fin)  # a delta message, maybe empty (held back)
                    if delta or fin or lp or (ctx.req.return_token_ids and new_ids):
                        yield ctx.chunk([ctx.choice_delta(c, delta, ctx.finish_reason(c), token_ids=new_ids,
                                                          logprobs=lp)], ctx.usage() if continuous else None)
    finally:
        if not stream.finished:  # client went away (or the server is cancelling us)
            ctx.state.loop.abort(ctx.rid)


async def stream_response(ctxs: list[Ctx], streams: list[RequestStream]):
    opts = ctxs[0].req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats and include_usage)
    gens = [_prompt_chunks(ctx, stream, continuous) for ctx, stream in zip(ctxs, streams)]
    chunks = gens[0] if len(gens) == 1 else _merged(gens)
    try:
        async for chunk in chunks:
            yield chunk
        if include_usage:
            yield ctxs[0].chunk([], batch_usage(ctxs))
        yield "data: [DONE]\n\n"
    finally:  # closed early (the client went away): the prompts' own finally blocks abort them now
        await chunks.aclose()


async def run_to_end(ctxs: list[Ctx], streams: list[RequestStream], request: Request) -> dict | None:
    """Wait for the requests to finish; their logprob entries by choice index, or None when
    the client went away first (the requests are then aborted, with one log line)."""
    lps = {c.index: [] for ctx in ctxs for c in ctx.choices}

    async def collect(ctx, stream):
        while not stream.finished:
            for c, _, _, new, _ in await next_updates(ctx, stream):
                lps[c.index] += new

    async def disconnected():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    # One task per prompt, each awaited or cancelled here: a gather() cancelled on a
    # disconnect held a CancelledError nobody retrieved, logged with its traceback.
    collectors = [asyncio.ensure_future(collect(ctx, stream)) for ctx, stream in zip(ctxs, streams)]
    watch = asyncio.ensure_future(disconnected())
    gone = False
    try:
        pending = set(collectors)
        while pending and not gone:
            done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
            gone = watch in done
            pending -= done
            if any(not t.cancelled() and t.exception() is not None for t in done if t is not watch):
                break  # an engine error: raised below, the other prompts aborted
    finally:
        if watch.done() and not watch.cancelled():
            watch.exception()  # retrieved: the disconnect (or a failed receive) is all it says
        watch.cancel()
        for t in collectors:
            t.cancel()  # no-op for those done
        aborted = [ctx.rid for ctx, stream in zip(ctxs, streams) if not stream.finished]
        for rid in aborted:
            ctxs[0].state.loop.abort(rid)
    errors = [t.exception() for t in collectors if t.done() and not t.cancelled() and t.exception() is not None]
    if gone:  # nobody reads the answer
        if aborted:
            logger.info("%s: the client disconnected; aborted %d engine request(s)", ctxs[0].response_id,
                        len(aborted))
        return None
    if errors:
        raise errors[0]
    return lps


async def complete_response(ctxs: list[Ctx], streams: list[RequestStream], request: Request):
    lps = await run_to_end(ctxs, streams, request)
    if lps is None:
        return Response(status_code=499)
    choices = []
    for ctx in ctxs:
        for c in ctx.choices:
            text, lp = ("", None) if not ctx.echo else ctx.echo_prefix(c)
            lp = _merge_lp(lp, ctx.logprobs_obj(c, c.token_ids, lps[c.index]))
            text += c.detok.sent
            if ctx.chat:
                d = {"index": c.index, "message": ctx.message(c, text), "logprobs": lp,
                     "finish_reason": ctx.finish_reason(c), "stop_reason": c.stop_reason}
            else:
                d = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason}
            if ctx.req.return_token_ids:
                d["token_ids"] = c.token_ids
                if not ctx.chat:
                    d["prompt_token_ids"] = ctx.prompt_ids
            choices.append(d)
    ctx = ctxs[0]
    body = {"id": ctx.response_id, "object": "chat.completion" if ctx.chat else "text_completion",
            "created": ctx.created, "model": ctx.state.model_name, "choices": choices, "usage": batch_usage(ctxs)}
    if ctx.req.return_token_ids and ctx.chat:
        body["prompt_token_ids"] = ctx.prompt_ids
    return JSONResponse(body)
