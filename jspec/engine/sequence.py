"""Host-side request state (plain Python)."""

from __future__ import annotations

import dataclasses
import enum

from jspec.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class SpecMetrics:
    """Speculative counters (vLLM names); all zero without speculation."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = dataclasses.field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int, k: int):
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def spec_stats_delta(before: dict, after: dict) -> dict:
    """The speculative counters accrued between two ``LLMEngine.stats()`` readings
    (SpecMetrics.as_dict's keys; mean_acceptance_length 0.0 when no draft was made)."""
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pb = list(before["accepted_per_position"]) + [0] * len(after["accepted_per_position"])
    d["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], pb)]
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # always set: the user's, or one the engine drew
    arrival: int  # admission order, for FCFS and preemption choice
    prompt_text: str | None = None
    status: Status = Status.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose K/V sit in the cache (prompt and outputs); the rest are computed next.
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # hashes of full committed blocks
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache pages
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at its first admission
    finish_reason: str | None = None
    num_emitted_reported: int = 0  # tokens already handed out by LLMEngine.step
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # proposals for the next step
    metrics: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    detok: object | None = None  # stopping.IncrementalText, for stop strings
    stop_text: str | None = None  # the text cut at a stop string
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # bad_words, tokenized
    logprobs: list = dataclasses.field(default_factory=list)  # per output token {id: Logprob}, if asked
    cumulative_logprob: float = 0.0
    prompt_logprobs: dict = dataclasses.field(default_factory=dict)  # prompt position -> {id: Logprob}
    # structured outputs: the request's llguidance matcher, at the state after output_token_ids
    grammar: object | None = None
    # times (time.time(), vLLM's RequestMetrics): set by LLMEngine, the scheduler's admission
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    grammar_closers: tuple = ()  # the tokens its closing paths are made of (structured.closing_path)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] followed by drafts, without concatenating the whole history
        (a decode step reads one token of a possibly very long sequence)."""
        n_p = len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:min(end, n_p)]
        if end > n_p:
            out = out + self.output_token_ids[max(start - n_p, 0) : end - n_p]
        if end > self.num_tokens:
            out = out + self.draft_token_ids[max(start - self.num_tokens, 0) : end - self.num_tokens]
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
