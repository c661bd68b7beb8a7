"""``LLM.get_metrics()``: the engine's counters as vLLM's offline metrics reader gives them
(``vllm.v1.metrics.reader``), so a vLLM script that reads them keeps working with this
import changed (``from jspec.metrics_reader import Counter, Vector``). vLLM's own
speculative-decoding example computes its acceptance rate and acceptance per draft
position from ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and the Vector ``..._num_accepted_tokens_per_pos``.

Names are the Prometheus families the server's /metrics exports (jspec/serve/metrics.py),
counters without the ``_total`` suffix, as vLLM's reader names them; labels ``model_name``
and ``engine`` ("0"). The speculative metrics are there only with a drafter, as in vLLM.
The values are cumulative over the engine's life (what the server's counters count too).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclasses.dataclass
class Vector(Metric):
    """An ordered array of integer counters (one a draft position)."""

    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A value that may go up or down."""

    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """vLLM's type, for scripts that test for it: this engine keeps no histograms offline
    (the server's /metrics has its latency histograms)."""

    count: int
    sum: float
    buckets: dict[str, int]


def engine_metrics(engine) -> list[Metric]:
    """The snapshot of an ``LLMEngine``'s counters and gauges."""
    s = engine.stats()
    labels = {"model_name": engine.model_name, "engine": "0"}

    def counter(name: str, key: str) -> Counter:
        return Counter(name, dict(labels), int(s[key]))

    pages = s["num_pages"]
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(s["num_running"])),
        Gauge("vllm:num_requests_waiting", dict(labels), float(s["num_waiting"])),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), 1.0 - s["num_free_pages"] / pages if pages else 0.0),
        counter("vllm:num_preemptions", "num_preemptions"),
        counter("vllm:prompt_tokens", "num_prompt_tokens"),
        counter("vllm:generation_tokens", "num_generation_tokens"),
        counter("vllm:prefix_cache_queries", "prefix_cache_query_tokens"),  # tokens, as vLLM's
        counter("vllm:prefix_cache_hits", "prefix_cache_hit_tokens"),
    ]
    if engine.K:
        per_pos = list(s["accepted_per_position"])
        out += [counter("vllm:spec_decode_num_drafts", "num_drafts"),
                counter("vllm:spec_decode_num_draft_tokens", "num_draft_tokens"),
                counter("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens"),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                       [int(v) for v in per_pos] + [0] * (engine.K - len(per_pos)))]
    return out
