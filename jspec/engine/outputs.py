"""What ``LLMEngine.step`` hands out, in vLLM's shapes (plain Python).

``RequestOutput`` keeps jspec's flat fields (``token_ids``, ``text``, ``finish_reason``: the
first completion's) and carries vLLM's ``outputs`` list of ``CompletionOutput`` (one per
sample, ``SamplingParams.n``), ``prompt_logprobs`` and per-token ``logprobs`` as lists of
dicts token id -> ``Logprob``, and ``metrics``, vLLM's ``RequestMetrics`` (its times, and
the speculative counters).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One token's log-probability (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; ties share the larger rank
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput)."""

    index: int
    text: str | None  # None without a tokenizer (filled when finished, or as it streams with stop strings)
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (None unless logprobs asked)
    logprobs: list[dict[int, Logprob]] | None  # per output token, when SamplingParams.logprobs is set
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS)
    _new: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def new_token_ids(self) -> list[int]:  # tokens added by the step that made this output
        return self._new

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """A request's times (vLLM's RequestMetrics: wall-clock seconds, ``time.time()``) and its
    speculative decoding counters (vLLM's names; zero without speculation)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # first admitted to a step
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def spec_counters(self) -> dict:
        """The speculative counters as a dict (SpecMetrics.as_dict's keys)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length}

    @classmethod
    def of(cls, seq) -> RequestMetrics:
        m = seq.metrics
        return cls(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.last_token_time,
                   seq.finished_time, m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens,
                   list(m.accepted_per_position))

    @classmethod
    def merged(cls, parts: list[RequestMetrics]) -> RequestMetrics:
        """The samples of one n > 1 request as one: the earliest arrival, scheduling and first
        token, the latest last token and finish (None until every sample finished), counters summed."""
        def pick(f, name):
            vals = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            return f(vals) if vals else None

        c = sum_metrics([p.spec_counters() for p in parts])
        done = all(p.finished_time is not None for p in parts)
        return cls(min(p.arrival_time for p in parts), pick(min, "first_scheduled_time"),
                   pick(min, "first_token_time"), pick(max, "last_token_time"),
                   pick(max, "finished_time") if done else None, c["num_drafts"], c["num_draft_tokens"],
                   c["num_accepted_tokens"], c["accepted_per_position"])


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (outputs[0])
    text: str | None  # None without a tokenizer (filled when finished)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    metrics: RequestMetrics | None
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)  # n samples (vLLM's field)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (None until admitted)

    @property
    def new_token_ids(self) -> list[int]:  # set by LLMEngine.step for streaming (outputs[0])
        return self._new

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason if self.outputs else None

    @property
    def logprobs(self):
        return self.outputs[0].logprobs if self.outputs else None

    _new: list = dataclasses.field(default_factory=list, repr=False)


def sum_metrics(parts: list[dict]) -> dict:
    """Several requests' (or samples') speculative counters (SpecMetrics.as_dict) as one: counts
    and per-position lists summed, the mean acceptance length recomputed from the sums."""
    metrics = {}
    for m in parts:
        for k, v in m.items():
            if isinstance(v, list):
                cur = metrics.setdefault(k, [])
                cur.extend([0] * (len(v) - len(cur)))
                for j, x in enumerate(v):
                    cur[j] += x
            elif k != "mean_acceptance_length":
                metrics[k] = metrics.get(k, 0) + v
    if "num_drafts" in metrics:
        metrics["mean_acceptance_length"] = (1 + metrics["num_accepted_tokens"] / metrics["num_drafts"]
                                             if metrics["num_drafts"] else 0.0)
    return metrics


def merge_samples(request_id: str, parts: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput of an n > 1 request from its samples' latest outputs (in index
    order): finished when every sample is; metrics summed."""
    first = next((p for p in parts if p.prompt_token_ids), parts[0])
    outs = [p.outputs[0] for p in parts]
    for i, o in enumerate(outs):
        o.index = i
    metrics = RequestMetrics.merged([p.metrics for p in parts if p.metrics is not None])
    out = RequestOutput(request_id, first.prompt, first.prompt_token_ids, list(outs[0].token_ids), outs[0].text,
                        all(p.finished for p in parts), outs[0].finish_reason, metrics, outs, first.prompt_logprobs,
                        first.num_cached_tokens)
    out._new = list(outs[0].new_token_ids)
    return out


def make_output(seq, new: list[int], tokenizer) -> RequestOutput:
    """A Sequence's RequestOutput after a step that appended ``new``. The text is decoded
    when finished (cut at a stop string when one ended it), or as it streams when stop
    strings keep it current anyway."""
    finished = seq.finish_reason is not None
    text = None
    if seq.stop_text is not None:
        text = seq.stop_text
    elif finished and tokenizer is not None:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
    elif seq.detok is not None:
        text = seq.detok.text
    want_lp = seq.params.logprobs is not None
    comp = CompletionOutput(0, text, list(seq.output_token_ids), seq.cumulative_logprob if want_lp else None,
                            list(seq.logprobs) if want_lp else None, seq.finish_reason, seq.stop_reason)
    comp._new = new
    prompt_lp = None
    if seq.params.prompt_logprobs is not None:
        prompt_lp = [None] + [seq.prompt_logprobs.get(i) for i in range(1, len(seq.prompt_token_ids))]
    out = RequestOutput(seq.request_id, seq.prompt_text, seq.prompt_token_ids, comp.token_ids, text, finished,
                        seq.finish_reason, RequestMetrics.of(seq), [comp], prompt_lp, seq.num_cached_tokens)
    out._new = new
    return out


class SampleGroups:
    """Requests with n > 1 run as n sequences ("{i}_{request id}", vLLM's child ids) whose
    outputs are merged back into one RequestOutput per step (``merge``)."""

    def __init__(self):
        self.children: dict[str, list[str]] = {}  # request id -> its samples' ids
        self.parent: dict[str, str] = {}  # sample id -> request id
        self.latest: dict[str, RequestOutput] = {}  # sample id -> its last output

    @staticmethod
    def child_ids(request_id: str, n: int) -> list[str]:
        return [f"{i}_{request_id}" for i in range(n)]

    def add(self, request_id: str, n: int) -> list[str]:
        ids = self.child_ids(request_id, n)
        self.children[request_id] = ids
        self.parent.update({c: request_id for c in ids})
        return ids

    def pop(self, request_id: str) -> list[str]:
        """Forget a request; its samples' ids (empty for an n = 1 request)."""
        ids = self.children.pop(request_id, [])
        for c in ids:
            self.parent.pop(c, None)
            self.latest.pop(c, None)
        return ids

    def merge(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with each group's samples merged into one (the others as they are)."""
        if not self.parent:
            return outs
        result, touched = [], []
        for o in outs:
            rid = self.parent.get(o.request_id)
            if rid is None:
                result.append(o)
                continue
            self.latest[o.request_id] = o
            if rid not in touched:
                touched.append(rid)
        for rid in touched:
            parts = []
            for c in self.children[rid]:
                o = self.latest.get(c)
                if o is None:  # no token yet: an empty, unfinished sample
                    o = RequestOutput(c, None, [], [], None, False, None, None,
                                      [CompletionOutput(0, None, [], None, None)])
                parts.append(o if any(x is o for x in outs) else _no_new(o))
            merged = merge_samples(rid, parts)
            result.append(merged)
            if merged.finished:
                self.pop(rid)
        return result


def _no_new(o: RequestOutput) -> RequestOutput:
    """``o`` as seen by a later step that added nothing to it."""
    comp = dataclasses.replace(o.outputs[0])
    comp._new = []
    out = dataclasses.replace(o, outputs=[comp])
    out._new = []
    return out
