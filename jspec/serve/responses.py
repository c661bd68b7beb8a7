"""OpenAI response bodies of one request: its ``n`` choices (one per sample), streamed as
SSE chunks or returned whole, with ``logprobs`` in OpenAI's shapes (completions:
tokens / token_logprobs / top_logprobs / text_offset; chat: content[{token, logprob,
bytes, top_logprobs}]) and ``echo`` (completions: the prompt, and its logprobs, first).

Stop strings end a request in the engine (SamplingParams.stop, min_tokens respected), which
also cuts the final text; here each choice holds back the last len(longest stop) - 1
characters while it streams, so text that a stop string will cut is never sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jspec.serve.engine_loop import RequestStream
from jspec.serve.protocol import APIError
from jspec.serve.text import Detokenizer


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else x  # JSON has no -inf (vLLM's clamp)


class Choice:
    """One sample's state as it streams."""

    def __init__(self, index: int, tokenizer, hold: int):
        self.index = index
        self.detok = Detokenizer(tokenizer, hold=hold)
        self.token_ids: list[int] = []
        self.n_lp = 0  # logprob entries already sent
        self.offset = 0  # text offset of the next token (completions' text_offset)
        self.finish_reason: str | None = None


class Ctx:
    def __init__(self, state, req, chat, rid, prompt_ids, params, prompt_text: str | None):
        self.state, self.req, self.chat, self.rid = state, req, chat, rid
        self.prompt_ids = prompt_ids
        tok = state.engine.tokenizer
        self.tokenizer = tok
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self.choices = [Choice(i, tok, hold) for i in range(params.n)]
        self.created = int(time.time())
        self.logprobs = params.logprobs  # top-N per token, or None
        self.echo = bool(getattr(req, "echo", False)) and not chat
        self.prompt_text = prompt_text
        self.prompt_logprobs = None  # the engine's, when echo asks for them
        self.spec_metrics: dict | None = None  # the request's speculative counters, when speculating

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    def usage(self):
        n = sum(len(c.token_ids) for c in self.choices)
        u = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n, "total_tokens": len(self.prompt_ids) + n}
        if self.spec_metrics is not None:
            # jspec's extension (OpenAI clients keep unknown usage fields): this request's
            # drafts, accepted tokens, acceptance per draft position and mean acceptance length.
            u["speculative_decoding"] = self.spec_metrics
        return u

    def chunk(self, choices, usage=None):
        d = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
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

    def choice_delta(self, c: Choice, text, finish_reason, role=False, token_ids=None, logprobs=None):
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            d = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            d = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.return_token_ids and token_ids is not None:
            d["token_ids"] = token_ids
        return d


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
        updates.append((c, delta, new_ids, lps, fin is not None))
    if out.finished:
        stream.finished = True
    return updates


async def stream_response(ctx: Ctx, stream: RequestStream):
    opts = ctx.req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats and include_usage)
    try:
        for c in ctx.choices:
            if ctx.chat:
                yield ctx.chunk([ctx.choice_delta(c, "", None, role=True)])
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
                    if delta or fin or lp or (ctx.req.return_token_ids and new_ids):
                        yield ctx.chunk([ctx.choice_delta(c, delta, c.finish_reason, token_ids=new_ids, logprobs=lp)],
                                        ctx.usage() if continuous else None)
        if include_usage:
            yield ctx.chunk([], ctx.usage())
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:  # client went away (or the server is cancelling us)
            ctx.state.loop.abort(ctx.rid)


async def complete_response(ctx: Ctx, stream: RequestStream, request: Request):
    lps = {c.index: [] for c in ctx.choices}

    async def collect():
        while not stream.finished:
            for c, _, _, new, _ in await next_updates(ctx, stream):
                lps[c.index] += new

    async def disconnected():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            ctx.state.loop.abort(ctx.rid)
    if task not in done:  # client disconnected; nobody reads the answer
        return Response(status_code=499)
    task.result()
    choices = []
    for c in ctx.choices:
        text, lp = ("", None) if not ctx.echo else ctx.echo_prefix(c)
        lp = _merge_lp(lp, ctx.logprobs_obj(c, c.token_ids, lps[c.index]))
        text += c.detok.sent
        if ctx.chat:
            d = {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                 "finish_reason": c.finish_reason}
        else:
            d = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if ctx.req.return_token_ids:
            d["token_ids"] = c.token_ids
        choices.append(d)
    body = {"id": ctx.rid, "object": "chat.completion" if ctx.chat else "text_completion",
            "created": ctx.created, "model": ctx.state.model_name, "choices": choices, "usage": ctx.usage()}
    if ctx.req.return_token_ids:
        body["prompt_token_ids"] = ctx.prompt_ids
    return JSONResponse(body)
