"""Continuous batching (plain Python).

Every step processes, per scheduled sequence, its uncomputed tokens
``token_ids[num_computed : num_computed + n]``; when that reaches the last token the step
also samples (and, with speculation, verifies the drafts appended after it). Prefill and
decode are the same operation with different n, which keeps preemption-by-recompute
trivial: reset ``num_computed`` and the sequence prefills its prompt *and* outputs again.

Policy (FCFS):
  1. Admit waiting requests while fewer than ``max_num_seqs`` run and pages allow their
     whole prompt plus lookahead (prefix-cache hits attach shared pages first).
  2. If any running sequence still has more than one uncomputed token, the step is a
     prefill step: chunks of up to ``max_prefill_chunk`` tokens, ``max_num_batched_tokens``
     in all. Otherwise it is a decode (or verify) step over every running sequence.
  3. A decode step that cannot get pages preempts the most recently admitted sequences
     (their pages are freed; they go back to the front of the queue).

Mixed policy (``SchedulerConfig.max_prefill_rows`` > 0; the server's default, with or without a drafter):
steps 1 and 3 as above, but step 2 packs every running decode row (last token + drafts,
oldest first) and then, under what ``max_num_batched_tokens`` leaves, chunks of the oldest
prefilling sequences (at most ``max_prefill_rows`` of them, ``max_prefill_chunk`` tokens
each) into one step: kind "mixed" (decode rows first, ``num_decode`` of them), or
"decode" / "prefill" when one of the two is empty. Running streams get a token every step
while a long prompt prefills.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from jspec.engine.block_manager import BlockManager
from jspec.engine.sequence import Sequence, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_model_len: int
    lookahead: int = 0  # K for EAGLE3/PEagle, K + 1 for DFlash, 0 without speculation
    drop_last_prefix_hit: bool = False  # EAGLE-style drafters recompute the last hit page
    max_prefill_rows: int = 0  # > 0: mixed steps, at most this many prefill rows per step
    num_drafts: int = 0  # K: drafts a decode row verifies (speculation)

    def __post_init__(self):
        if self.max_prefill_rows < 0:
            raise ValueError(f"max_num_partial_prefills must be >= 0, got {self.max_prefill_rows}")
        if self.max_prefill_rows and self.max_num_batched_tokens <= self.max_num_seqs * (1 + self.num_drafts):
            # decode rows come first: a budget they can fill would starve every prompt
            per_row = f" x (1 + num_speculative_tokens={self.num_drafts})" if self.num_drafts else ""
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed max_num_seqs="
                             f"{self.max_num_seqs}{per_row} when mixing decode rows and prefill chunks")


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # uncomputed tokens processed this step
    sample: bool  # reaches the last token: sample (and verify drafts)


@dataclasses.dataclass
class SchedulerOutput:
    kind: str  # "prefill" | "decode" | "mixed" (decode rows, then prefill chunks)
    seqs: list[ScheduledSeq]
    preempted: list[Sequence]
    num_decode: int = 0  # "mixed": seqs[:num_decode] are decode rows


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # A mixed step's decode rows -> the same rows verifying the drafts dynamic speculation
        # keeps (the engine's); None: every draft. Asked before the prompts' chunks take the
        # budget the rows leave.
        self.mixed_drafts: Callable[[SchedulerOutput], SchedulerOutput] | None = None

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """A waiting request has a row to take now (fewer than max_num_seqs running): the next
        step schedules it. One that has none (saturation) waits for a row to end."""
        return bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs

    def _slots_needed(self, seq: Sequence, num_new: int) -> int:
        # The drafter writes up to `lookahead` slots past this step's tokens, so those pages
        # must exist before the step (prefill too: vLLM #42971). The engine caps the drafts
        # of a sequence near max_model_len, so this never exceeds max_model_len + lookahead.
        return seq.num_computed + num_new + self.cfg.lookahead

    def _admit(self):
        """Admit FCFS while the whole prompt (plus lookahead) fits.

        Reserving the full prompt up front means a running prefill never starves midway
        (admitting on the first chunk alone lets several long prompts each hold part of
        the pool and none finish). One page of headroom per running sequence keeps
        admissions from immediately forcing decode-time preemptions.
        """
        budget = self.cfg.max_num_batched_tokens
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = self.blocks.allocate_prefix(seq, self.cfg.drop_last_prefix_hit)
            need = self.blocks.pages_needed(seq, seq.num_tokens + self.cfg.lookahead)
            headroom = len(self.running)
            if need + headroom > self.blocks.num_free_pages and self.running:
                self.blocks.free(seq)  # give the prefix hits back; try again next step
                seq.num_computed = 0
                break
            if not self.blocks.ensure_slots(seq, seq.num_tokens + self.cfg.lookahead):
                self.blocks.free(seq)
                seq.num_computed = 0
                break
            budget -= min(seq.num_tokens - seq.num_computed, self.cfg.max_prefill_chunk)
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # a preempted sequence's re-admission does not count (vLLM)
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)

    def preempt(self, seq: Sequence):
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.draft_token_ids = []
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str):
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput | None:
        self._admit()
        if not self.running:
            return None
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        if self.cfg.max_prefill_rows > 0:
            return self._schedule_mixed()
        if prefilling:
            return self._schedule_prefill(prefilling)
        return self._schedule_decode()

    def _schedule_prefill(self, prefilling: list[Sequence], budget: int | None = None,
                          max_rows: int | None = None, preempt: bool = True) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens if budget is None else budget
        out = []
        for seq in sorted(prefilling, key=lambda s: s.arrival):
            n = min(seq.num_tokens - seq.num_computed, self.cfg.max_prefill_chunk, budget)
            if n <= 0 or (max_rows is not None and len(out) >= max_rows):
                break
            if not self.blocks.ensure_slots(seq, self._slots_needed(seq, n)):
                continue  # pages are short: this chunk waits; decodes free pages as they end
            budget -= n
            out.append(ScheduledSeq(seq, n, seq.num_computed + n == seq.num_tokens))
        if not out and not preempt:
            return SchedulerOutput("prefill", [], [])  # beside decode rows, which make progress
        if not out:
            # Nothing fits: preempt the newest sequence so the oldest can make progress.
            victim = max(self.running, key=lambda s: s.arrival)
            self.preempt(victim)
            return SchedulerOutput("prefill", [], [victim])
        return SchedulerOutput("prefill", out, [])

    def _schedule_mixed(self) -> SchedulerOutput:
        """Decode rows first (as a decode step: growth may preempt the newest sequences),
        then prefill chunks in the budget they leave."""
        dec = self._schedule_decode(only_decoding=True)
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        if prefilling and dec.seqs and self.mixed_drafts is not None:
            dec = self.mixed_drafts(dec)
        budget = self.cfg.max_num_batched_tokens - sum(r.num_new for r in dec.seqs)
        if not prefilling or (dec.seqs and budget <= 0):
            return dec if dec.seqs or dec.preempted else self._schedule_prefill(prefilling)
        if not dec.seqs:
            pre = self._schedule_prefill(prefilling, max_rows=self.cfg.max_prefill_rows)
            return SchedulerOutput(pre.kind, pre.seqs, dec.preempted + pre.preempted)
        rows = self._schedule_prefill(prefilling, budget, self.cfg.max_prefill_rows, preempt=False).seqs
        if not rows:  # pages are short for every chunk: the decode rows go alone
            return dec
        return SchedulerOutput("mixed", dec.seqs + rows, dec.preempted, num_decode=len(dec.seqs))

    def _schedule_decode(self, only_decoding: bool = False) -> SchedulerOutput:
        preempted = []
        out = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING:
                continue
            if only_decoding and seq.num_tokens - seq.num_computed > 1:
                continue
            n = seq.num_tokens - seq.num_computed + len(seq.draft_token_ids)  # last token + drafts
            while not self.blocks.ensure_slots(seq, self._slots_needed(seq, n)):
                victim = max(self.running, key=lambda s: s.arrival)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                out.append(ScheduledSeq(seq, n, True))
        return SchedulerOutput("decode", out, preempted)
