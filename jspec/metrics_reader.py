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


# The engine's cumulative counters, each exported under vLLM's name by ``engine_metrics`` and
# by the server's /metrics (jspec/serve/metrics.py): (name, LLMEngine.stats() key, help).
ENGINE_COUNTERS = (
    ("vllm:num_preemptions", "num_preemptions", "Preemptions (KV pages ran out)."),
    ("vllm:prefix_cache_queries", "prefix_cache_query_tokens", "Prefix-cache lookups (tokens)."),
    ("vllm:prefix_cache_hits", "prefix_cache_hit_tokens", "Prefix-cache hits (tokens)."),
    ("vllm:prompt_tokens", "num_prompt_tokens", "Prefill tokens processed."),
    ("vllm:generation_tokens", "num_generation_tokens", "Tokens generated."),
)
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "num_drafts", "Draft proposals."),
    ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed."),
    ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
    # dynamic speculation: drafts per step = num_draft_tokens / this (jspec/engine/dynamic_spec.py)
    ("jspec:spec_decode_num_decode_steps", "num_decode_steps", "Decode steps, drafting or not."),
)


def engine_metrics(engine) -> list[Metric]:
    """The snapshot of an ``LLMEngine``'s counters and gauges."""
    s = engine.stats()
    labels = {"model_name": engine.model_name, "engine": "0"}

    pages = s["num_pages"]
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(s["num_running"])),
        Gauge("vllm:num_requests_waiting", dict(labels), float(s["num_waiting"])),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), 1.0 - s["num_free_pages"] / pages if pages else 0.0),
    ]
    counters = ENGINE_COUNTERS + (SPEC_COUNTERS if engine.K else ())
    out += [Counter(name, dict(labels), int(s[key])) for name, key, _ in counters]
    if engine.K:
        per_pos = list(s["accepted_per_position"])
        out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                          [int(v) for v in per_pos] + [0] * (engine.K - len(per_pos))))
    return out
