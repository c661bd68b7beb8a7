"""The single engine thread, and the asyncio side that talks to it.

``LLMEngine`` is synchronous and not thread-safe, so exactly one thread (started here) ever
touches it. The HTTP handlers (asyncio, main thread) send it commands through a thread-safe
queue (add / abort / abort-all / stop); the thread drains the queue, runs ``engine.step()``
whenever there is work (continuous batching: requests join and leave between steps), and
hands each step's outputs back to the event loop with one ``call_soon_threadsafe`` per step,
into per-request ``asyncio.Queue``s. When idle it blocks on the command queue.

An abort (client disconnect, stop string hit, shutdown) is applied before the next step, so
the request's KV pages are free at most one step after the abort is queued.

The thread also keeps /metrics' gauges and counters, and (with a ``StatLogger``) logs vLLM's
periodic stats lines from the engine's counters, waking for them when idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any

logger = logging.getLogger("jspec.serve")


@dataclasses.dataclass
class Output:
    """A copy of one RequestOutput, safe to hand to another thread."""
    token_ids: list[int]
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None
    error: str | None = None
    metrics: dict | None = None  # the request's speculative counters (RequestOutput.metrics)
    outputs: list | None = None  # RequestOutput.outputs: per sample (n), made for this step alone
    prompt_logprobs: list | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served


class RequestStream:
    """Outputs of one request, consumed on the event loop."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.finished = False

    async def get(self) -> Output:
        out = await self.queue.get()
        # coalesce: only the newest output matters (token_ids are cumulative)
        while not out.finished and not self.queue.empty():
            out = self.queue.get_nowait()
        if out.finished:
            self.finished = True
        return out


@dataclasses.dataclass
class _ReqState:
    stream: RequestStream
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_time: float | None = None
    num_tokens: int = 0
    token_ids: list = dataclasses.field(default_factory=list)


_STOP = object()
_ABORT_ALL = object()


class EngineLoop:
    def __init__(self, engine, metrics=None, idle_wait: float = 0.5, stat_logger=None):
        self.engine = engine
        self.metrics = metrics
        self.stat_logger = stat_logger  # metrics.StatLogger: the periodic throughput line, if logged
        self.idle_wait = idle_wait
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, _ReqState] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prev_stats: dict[str, Any] = {}
        self.snapshot: dict[str, Any] = {}
        self.num_steps = 0
        self.error: str | None = None

    # ---------------------------------------------------------------- event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._prev_stats = self._stats()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add_request(self, request_id: str, prompt, params, num_prompt_tokens: int,
                          arrival: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises the
        engine's ValueError for a request it refuses."""
        stream = RequestStream(request_id)
        fut = self._loop.create_future()
        self._cmds.put(("add", request_id, prompt, params, num_prompt_tokens,
                        arrival or time.monotonic(), stream, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def finish_on_stop_string(self, request_id: str) -> None:
        """End a request whose text reached one of its stop strings: the engine frees it as
        an abort would, but it counts (metrics, latency) as finished with reason "stop"."""
        self._cmds.put(("stop", request_id))

    def abort_all(self) -> None:
        self._cmds.put(_ABORT_ALL)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._cmds.put(_STOP)
            self._thread.join(timeout)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while True:
            try:
                return self._loop_body()
            except Exception:  # a bug here must not leave requests hanging forever
                self.error = traceback.format_exc()
                logger.error("engine loop error; failing in-flight requests\n%s", self.error)
                for rid in list(self._reqs):
                    self._abort(rid, error="internal server error")

    def _loop_body(self) -> None:
        eng = self.engine
        while True:
            cmds = []
            if not eng.has_unfinished_requests():
                try:
                    cmds.append(self._cmds.get(timeout=self.idle_wait))
                except queue.Empty:
                    if self.stat_logger is not None and self.stat_logger.due(time.monotonic()):
                        self.stat_logger.observe(self._stats(), time.monotonic())  # the last busy interval's line
                    continue
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for cmd in cmds:
                if cmd is _STOP:
                    stop = True
                elif cmd is _ABORT_ALL:
                    for rid in list(self._reqs):
                        self._abort(rid)
                elif cmd[0] == "add":
                    self._add(*cmd[1:])
                else:
                    self._abort(cmd[1], reason="stop" if cmd[0] == "stop" else "abort")
            if stop:
                for rid in list(self._reqs):
                    self._abort(rid)
                self._publish()
                return
            if eng.has_unfinished_requests():
                try:
                    outs = eng.step()
                except Exception:  # keep serving: fail the in-flight requests, not the server
                    self.error = traceback.format_exc()
                    logger.error("engine.step() failed; aborting in-flight requests\n%s", self.error)
                    for rid in list(self._reqs):
                        self._abort(rid, error="internal engine error: "
                                    + self.error.strip().splitlines()[-1])
                    self._publish()
                    continue
                self.num_steps += 1
                self._dispatch(outs)
            self._publish()

    def _add(self, rid, prompt, params, n_prompt, arrival, stream, fut) -> None:
        if fut.cancelled():
            return
        try:
            self.engine.add_request(rid, prompt, params)
        except Exception as e:  # ValueError from the engine: a bad request
            self._call(_resolve, fut, e)
            return
        self._reqs[rid] = _ReqState(stream, arrival, n_prompt)
        self._call(_resolve, fut, None)

    def _abort(self, rid: str, error: str | None = None, reason: str = "abort") -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            logger.exception("abort_request(%s) failed", rid)
        st = self._reqs.pop(rid, None)
        if st is None:
            return
        if self.metrics is not None:
            self.metrics.success(reason)
            if reason == "stop":  # a completed request: its latency and sizes count
                self.metrics.e2e.observe(time.monotonic() - st.arrival)
                self.metrics.req_prompt_tokens.observe(st.num_prompt_tokens)
                self.metrics.req_gen_tokens.observe(len(st.token_ids))
        out = Output(token_ids=list(st.token_ids), num_prompt_tokens=st.num_prompt_tokens, finished=True,
                     finish_reason=reason, error=error)
        self._call(_deliver, [(st.stream, out, True)])

    def _dispatch(self, outs) -> None:
        now = time.monotonic()
        m = self.metrics
        items = []
        for o in outs:
            st = self._reqs.get(o.request_id)
            if st is None:
                continue
            ids = list(o.token_ids)
            st.token_ids = ids
            if len(ids) > st.num_tokens:
                if st.first_token is None:
                    st.first_token = now
                    if m is not None:
                        m.ttft.observe(now - st.arrival)
                elif m is not None:
                    m.itl.observe(now - st.last_time)
                st.last_time = now
                st.num_tokens = len(ids)
            n_prompt = len(o.prompt_token_ids) if o.prompt_token_ids is not None else st.num_prompt_tokens
            out = Output(ids, n_prompt, bool(o.finished), o.finish_reason if o.finished else None,
                         metrics=o.metrics.spec_counters() if o.metrics else None, outputs=list(o.outputs),
                         prompt_logprobs=o.prompt_logprobs, num_cached_tokens=o.num_cached_tokens)
            if o.finished:
                del self._reqs[o.request_id]
                if m is not None:
                    m.success(o.finish_reason)
                    m.e2e.observe(now - st.arrival)
                    m.req_prompt_tokens.observe(n_prompt)
                    m.req_gen_tokens.observe(sum(len(c.token_ids) for c in o.outputs) if o.outputs else len(ids))
            items.append((st.stream, out, False))
        if items:
            self._call(_deliver, items)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # event loop closed (shutdown)
            pass

    def _stats(self) -> dict:
        try:
            return dict(self.engine.stats())
        except Exception:
            return {}

    def _publish(self) -> None:
        """Refresh gauges/counters and the snapshot read by /v1/debug/engine and /metrics."""
        eng = self.engine
        s = self._stats()
        free, total = int(eng.num_free_pages), int(eng.num_pages)
        snap = {
            "num_free_pages": free, "num_pages": total,
            "num_running": int(s.get("num_running", 0)), "num_waiting": int(s.get("num_waiting", 0)),
            "num_active_requests": len(self._reqs), "num_steps": self.num_steps,
            "num_compilations": int(s.get("num_compilations", 0)),
        }
        m = self.metrics
        if m is not None:
            m.free_pages.set(free)
            m.total_pages.set(total)
            m.kv_usage.set(1.0 - free / total if total else 0.0)
            m.num_running.set(snap["num_running"])
            m.num_waiting.set(snap["num_waiting"])
            m.active_streams.set(len(self._reqs))
            m.num_compilations.set(s.get("num_compilations", 0))
            p = self._prev_stats
            for key, c in m.engine_counters.items():
                d = s.get(key, 0) - p.get(key, 0)
                if d > 0:
                    c.inc(d)
            prev_pos = list(p.get("accepted_per_position") or [])
            for i, v in enumerate(s.get("accepted_per_position") or []):
                d = v - (prev_pos[i] if i < len(prev_pos) else 0)
                if d > 0:
                    m.accepted_at(i, d)
            self._prev_stats = s
        if self.stat_logger is not None:
            self.stat_logger.observe(s, time.monotonic())
        self.snapshot = snap


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(items) -> None:
    for stream, out, _ in items:
        stream.queue.put_nowait(out)
