"""Prometheus metrics, under vLLM's names where vLLM has one (so dashboards carry over).

Counters are declared without ``_total``; prometheus_client appends it in the text format
(``vllm:prompt_tokens`` -> ``vllm:prompt_tokens_total``), exactly as vLLM does. All metrics
carry the ``model_name`` label like vLLM's. Updated from the engine thread (prometheus_client
is thread-safe) and from the HTTP middleware. ``StatLogger``: vLLM's periodic stats lines in
the log, from the same counters.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jspec.metrics_reader import ENGINE_COUNTERS, SPEC_COUNTERS

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry(auto_describe=True)
        L = ["model_name"]
        self.model_name = model_name

        def counter(name, doc, labels=()):
            return Counter(name, doc, L + list(labels), registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        # scheduler / cache state
        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).")
        self.free_pages = gauge("jspec:kv_cache_free_pages", "Free KV-cache pages.")
        self.total_pages = gauge("jspec:kv_cache_total_pages", "Total KV-cache pages.")
        self.active_streams = gauge("jspec:num_active_requests",
                                    "Requests the server is tracking (added, not finished).")
        self.num_compilations = gauge("jspec:num_compilations", "Jitted step shapes compiled so far.")
        # the engine's own counters (LLMEngine.stats() key -> counter), speculative decoding's
        # (vLLM v1 names) included: the table LLM.get_metrics reads too
        self.engine_counters = {key: counter(name, doc).labels(model_name)
                                for name, key, doc in ENGINE_COUNTERS + SPEC_COUNTERS}
        # requests
        self._success = counter("vllm:request_success", "Finished requests, by finish reason.",
                                ["finished_reason"])
        self.rejected = counter("jspec:request_rejected",
                                "Requests refused with an error status, by status code.", ["status"])
        self.http_requests = counter("jspec:http_requests",
                                     "HTTP requests by handler, method and status.",
                                     ["handler", "method", "status"])
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between engine outputs of a request.",
                        ITL_BUCKETS)
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                      TOKEN_BUCKETS)
        self.req_gen_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                                   TOKEN_BUCKETS)
        self._spec_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position in the draft.", ["position"])
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def success(self, reason: str):
        self._success.labels(self.model_name, reason or "stop").inc()

    def accepted_at(self, position: int, n: float):
        self._spec_per_pos.labels(self.model_name, str(position)).inc(n)

    def reject(self, status: int):
        self.rejected.labels(self.model_name, str(status)).inc()

    def http(self, handler: str, method: str, status: int):
        self.http_requests.labels(self.model_name, handler, method, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """vLLM's periodic log lines (its LoggingStatLogger and SpecDecodingLogging): every
    ``interval`` seconds in which the engine had work, the interval's prompt and generation
    throughput, the requests running and waiting, the KV cache's usage and the prefix cache's
    hit rate, and, speculating, the interval's drafts and acceptance. Nothing when idle.

    Fed ``LLMEngine.stats()`` by the engine thread (``observe``), which alone touches it."""

    def __init__(self, interval: float = 10.0, speculating: bool = False, kv_label: str = "KV cache usage",
                 logger: logging.Logger | None = None):
        self.interval = interval
        self.speculating = speculating
        self.kv_label = kv_label  # "GPU KV cache usage" on a GPU, as vLLM's line; the device's name elsewhere
        self.logger = logger or logging.getLogger("jspec.serve.stats")
        self._last: dict | None = None  # the stats at the start of the interval
        self._since = 0.0
        self._hit_rate = 0.0  # the last interval's with prefix-cache lookups (vLLM's is over recent requests)

    def due(self, now: float) -> bool:
        return self._last is None or now - self._since >= self.interval

    def observe(self, s: dict, now: float) -> list[str]:
        """The lines logged (none before the interval is over, or when it was idle)."""
        if self._last is None:
            self._last, self._since = s, now
            return []
        dt = now - self._since
        if dt < self.interval:
            return []
        p, self._last, self._since = self._last, s, now

        def d(key):
            return s.get(key, 0) - p.get(key, 0)

        prompt, gen = d("num_prompt_tokens"), d("num_generation_tokens")
        running, waiting = s.get("num_running", 0), s.get("num_waiting", 0)
        if d("prefix_cache_query_tokens"):
            self._hit_rate = d("prefix_cache_hit_tokens") / d("prefix_cache_query_tokens")
        if not (prompt or gen or running or waiting):
            return []  # idle: nothing to say (vLLM logs it at debug level only)
        pages = s.get("num_pages", 0)
        usage = 1.0 - s.get("num_free_pages", 0) / pages if pages else 0.0
        lines = [f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} "
                 f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, {self.kv_label}: {usage:.1%}, "
                 f"Prefix cache hit rate: {self._hit_rate:.1%}"]
        drafts = d("num_drafts")
        if self.speculating and drafts:
            drafted, accepted = d("num_draft_tokens"), d("num_accepted_tokens")
            now_pos, then_pos = list(s.get("accepted_per_position") or []), list(p.get("accepted_per_position") or [])
            then_pos += [0] * (len(now_pos) - len(then_pos))
            per_pos = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(now_pos, then_pos))
            lines.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                         f"Accepted throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: "
                         f"{drafted / dt:.2f} tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                         f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: "
                         f"{accepted / drafted if drafted else 0.0:.1%}")
        for line in lines:
            self.logger.info("%s", line)
        return lines
