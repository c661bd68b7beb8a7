"""Unit tests of jspec.engine.scheduler (plain Python, no jax, no model).

The policy under test (scheduler.py's module docstring, docs/architecture.md "Decisions"):
  1. FCFS admission while fewer than max_num_seqs run and the pages hold the whole prompt
     plus lookahead (prefix hits attached first), keeping one page of headroom per running
     sequence;
  2. a prefill step while any running sequence has more than one uncomputed token:
     chunks of at most max_prefill_chunk, max_num_batched_tokens in all, oldest first;
     otherwise a decode step over every running sequence (last token + drafts);
  3. decode growth that finds no pages preempts the most recently admitted sequence:
     its pages are freed, num_computed is reset, it goes back to the front of the queue
     and later recomputes its prompt and outputs.

`Sim` below plays the engine's part (LLMEngine._advance / _run): it advances
num_computed, appends sampled tokens, finishes sequences at max_tokens and commits pages.
"""

from __future__ import annotations

import dataclasses

import pytest

from jspec.engine.block_manager import BlockManager
from jspec.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from jspec.engine.sequence import Sequence, Status
from jspec.sampling_params import SamplingParams

PS = 4  # page size used throughout


def make_seq(n_prompt, arrival, max_tokens=16, start=None) -> Sequence:
    start = 1000 * (arrival + 1) if start is None else start
    return Sequence(request_id=f"r{arrival}", prompt_token_ids=list(range(start, start + n_prompt)),
                    params=SamplingParams(max_tokens=max_tokens), seed=arrival, arrival=arrival)


class Sim:
    """A scheduler, its block manager and the engine's bookkeeping between steps."""

    def __init__(self, num_pages, *, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=64,
                 max_model_len=128, lookahead=0, drop_last_prefix_hit=False, prefix_caching=True,
                 hash_next_token=False, num_drafts=0, max_prefill_rows=0):
        self.cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_prefill_chunk=max_prefill_chunk, max_model_len=max_model_len,
                                   lookahead=lookahead, drop_last_prefix_hit=drop_last_prefix_hit,
                                   max_prefill_rows=max_prefill_rows)
        self.blocks = BlockManager(num_pages, PS, prefix_caching, hash_next_token=hash_next_token)
        self.sched = Scheduler(self.cfg, self.blocks)
        self.num_drafts = num_drafts
        self.finished: list[Sequence] = []

    def add(self, *seqs):
        for s in seqs:
            self.sched.add(s)

    def schedule(self) -> SchedulerOutput | None:
        return self.sched.schedule()

    def apply(self, out: SchedulerOutput | None):
        """The engine's side of a step: positions computed, tokens emitted, finish or commit."""
        if out is None:
            return
        for i, r in enumerate(out.seqs):
            seq = r.seq
            drafts = list(seq.draft_token_ids)
            if (out.kind == "decode" or i < out.num_decode) and drafts:  # a verification row
                # accept a deterministic, varying number of drafts (0 .. all)
                n_acc = (seq.arrival + seq.num_tokens) % (len(drafts) + 1)
                emitted = drafts[:n_acc] + [self.token(seq, n_acc)]
                computed = n_acc + 1
            else:
                emitted = [self.token(seq, 0)] if r.sample else []
                computed = r.num_new
            seq.num_computed += computed
            for t in emitted:
                seq.output_token_ids.append(t)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish_reason = "length"
                    break
            if seq.finish_reason:
                self.sched.finish(seq, seq.finish_reason)
                self.finished.append(seq)
                continue
            self.blocks.commit(seq, seq.num_computed)
            if r.sample and self.num_drafts:
                room = self.cfg.max_model_len - seq.num_tokens - 1
                seq.draft_token_ids = [self.token(seq, 1 + i) for i in range(max(0, min(self.num_drafts, room)))]
            elif r.sample:
                seq.draft_token_ids = []

    @staticmethod
    def token(seq, k):
        return 3 + (7 * seq.num_tokens + 13 * seq.arrival + k) % 500

    def step(self) -> SchedulerOutput | None:
        out = self.schedule()
        self.apply(out)
        return out


def cached_pages(sim, n_tokens):
    """Cached page ids of the prompt range(1000, 1000 + n_tokens), chain order."""
    tokens = list(range(1000, 1000 + n_tokens))
    pages, parent = [], None
    for i in range(n_tokens // PS):
        parent = BlockManager.chain_hash(parent, tokens[i * PS:(i + 1) * PS])
        pages.append(sim.blocks.hash_page[parent])
    return pages


def ids(out: SchedulerOutput):
    return [(r.seq.request_id, r.num_new, r.sample) for r in out.seqs]


# ---- admission ------------------------------------------------------------------------------


def test_admission_reserves_whole_prompt_plus_lookahead_before_first_chunk():
    sim = Sim(16, max_num_batched_tokens=8, max_prefill_chunk=8, lookahead=3)
    a = make_seq(10, 0)
    sim.add(a)
    out = sim.schedule()
    assert out.kind == "prefill" and out.preempted == []
    assert ids(out) == [("r0", 8, False)]  # first chunk only ...
    assert len(a.pages) == 4  # ... but pages for all 10 prompt tokens + 3 lookahead slots
    assert a.status is Status.RUNNING and sim.sched.running == [a] and not sim.sched.waiting
    assert sim.blocks.num_free_pages == 12


def test_admission_is_fcfs_with_one_page_headroom_per_running_sequence():
    sim = Sim(6)
    a, b, c = make_seq(12, 0), make_seq(10, 1), make_seq(2, 2)
    sim.add(a, b, c)
    out = sim.schedule()
    # a takes 3 pages; b needs 3 of the 3 left, plus 1 headroom for a: it waits, and c
    # (which would fit) waits behind it.
    assert [r.seq for r in out.seqs] == [a]
    assert list(sim.sched.waiting) == [b, c]
    for s in (b, c):
        assert s.status is Status.WAITING and s.pages == [] and s.num_computed == 0
    assert sim.blocks.num_free_pages == 3
    sim.sched.finish(a, "abort")
    out = sim.schedule()
    # Nothing running: b needs no headroom; then c needs 1 page + 1 headroom of the 3 left.
    assert [r.seq for r in out.seqs] == [b, c]
    assert ids(out) == [("r1", 10, True), ("r2", 2, True)]
    assert not sim.sched.waiting


def test_prompt_larger_than_the_pool_is_never_admitted():
    sim = Sim(3)
    fits, too_big = make_seq(12, 0), make_seq(13, 1)
    sim.add(too_big)
    assert sim.schedule() is None
    assert too_big.status is Status.WAITING and too_big.pages == []
    assert sim.blocks.num_free_pages == 3
    sim2 = Sim(3)
    sim2.add(fits)  # exactly the pool, nothing running: no headroom needed
    assert ids(sim2.schedule()) == [("r0", 12, True)]
    assert sim2.blocks.num_free_pages == 0


def test_max_num_seqs_caps_running_sequences():
    sim = Sim(32, max_num_seqs=2)
    seqs = [make_seq(3, i, max_tokens=2) for i in range(3)]
    sim.add(*seqs)
    out = sim.step()
    assert [r.seq for r in out.seqs] == seqs[:2]
    assert list(sim.sched.waiting) == [seqs[2]]
    out = sim.step()  # decode: the two running ones finish (max_tokens=2)
    assert out.kind == "decode" and [r.seq for r in out.seqs] == seqs[:2]
    assert [s.status for s in seqs[:2]] == [Status.FINISHED] * 2
    out = sim.step()
    assert [r.seq for r in out.seqs] == [seqs[2]]


def test_admission_stops_when_the_token_budget_is_spent():
    sim = Sim(32, max_num_batched_tokens=16, max_prefill_chunk=16)
    a, b, c = make_seq(10, 0), make_seq(10, 1), make_seq(10, 2)
    sim.add(a, b, c)
    out = sim.schedule()
    # a uses 10 of 16, b is admitted on the remaining 6, c waits.
    assert sim.sched.running == [a, b] and list(sim.sched.waiting) == [c]
    assert ids(out) == [("r0", 10, True), ("r1", 6, False)]
    assert sum(r.num_new for r in out.seqs) == 16


# ---- chunked prefill -------------------------------------------------------------------


def test_chunked_prefill_then_decode():
    sim = Sim(32, max_num_batched_tokens=64, max_prefill_chunk=16)
    a = make_seq(40, 0)
    sim.add(a)
    steps = []
    for _ in range(5):
        out = sim.step()
        steps.append((out.kind, ids(out)))
    assert steps == [
        ("prefill", [("r0", 16, False)]),
        ("prefill", [("r0", 16, False)]),
        ("prefill", [("r0", 8, True)]),  # reaches the last prompt token: samples
        ("decode", [("r0", 1, True)]),
        ("decode", [("r0", 1, True)]),
    ]
    assert a.num_computed == 42 and len(a.output_token_ids) == 3


def test_prefill_chunks_share_the_token_budget_oldest_first():
    sim = Sim(64, max_num_batched_tokens=24, max_prefill_chunk=16)
    a, b = make_seq(30, 0), make_seq(30, 1)
    sim.add(a, b)
    seen = []
    while True:
        out = sim.step()
        if out.kind != "prefill":
            break
        assert sum(r.num_new for r in out.seqs) <= 24
        assert all(r.num_new <= 16 for r in out.seqs)
        seen.append(ids(out))
    assert seen == [
        [("r0", 16, False), ("r1", 8, False)],
        [("r0", 14, True), ("r1", 10, False)],
        [("r1", 12, True)],
    ]


def test_decode_waits_while_any_sequence_prefills_then_batches_all():
    """Continuous batching: a request that arrives mid-decode is prefilled in steps of its
    own, then joins the running batch's decode steps."""
    sim = Sim(32)
    a, b = make_seq(5, 0), make_seq(9, 1)
    sim.add(a)
    assert sim.step().kind == "prefill"
    assert ids(sim.step()) == [("r0", 1, True)]
    sim.add(b)
    out = sim.step()
    assert out.kind == "prefill" and ids(out) == [("r1", 9, True)]  # a does not decode here
    out = sim.step()
    assert out.kind == "decode" and ids(out) == [("r0", 1, True), ("r1", 1, True)]


def test_decode_schedules_last_token_plus_drafts_and_reserves_lookahead():
    K = 3
    sim = Sim(32, lookahead=K, num_drafts=K)
    a = make_seq(5, 0)
    sim.add(a)
    out = sim.step()
    assert ids(out) == [("r0", 5, True)]
    assert len(a.pages) == 2  # 5 prompt slots + 3 lookahead
    assert len(a.draft_token_ids) == K and a.num_tokens == 6 and a.num_computed == 5
    out = sim.schedule()
    assert out.kind == "decode" and ids(out) == [("r0", 1 + K, True)]
    # slots for the last token, the 3 drafts and 3 more lookahead slots: 5 + 4 + 3 = 12
    assert len(a.pages) == 3


# ---- preemption by recompute ------------------------------------------------------------


def test_decode_growth_preempts_the_newest_sequence():
    sim = Sim(3, prefix_caching=False)
    a, b = make_seq(3, 0), make_seq(3, 1)
    sim.add(a, b)
    assert ids(sim.step()) == [("r0", 3, True), ("r1", 3, True)]  # one page each, 1 free
    assert ids(sim.step()) == [("r0", 1, True), ("r1", 1, True)]  # slot 4: still page one
    out = sim.schedule()  # slot 5: both need a second page, one is left
    assert out.kind == "decode"
    assert [r.seq for r in out.seqs] == [a]
    assert out.preempted == [b]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.pages == [] and b.draft_token_ids == []
    assert list(sim.sched.waiting) == [b] and sim.sched.running == [a]
    assert b.output_token_ids and b.num_tokens == 5  # outputs are kept, to be recomputed
    assert sim.sched.num_preemptions == 1
    assert len(a.pages) == 2 and sim.blocks.num_free_pages == 1
    sim.apply(out)
    # b needs 2 pages + 1 headroom: not yet.
    out = sim.step()
    assert [r.seq for r in out.seqs] == [a] and b.status is Status.WAITING
    sim.sched.finish(a, "abort")
    out = sim.schedule()
    # Recompute: b prefills its prompt and the tokens it had generated, then samples.
    assert out.kind == "prefill" and ids(out) == [("r1", 5, True)]
    assert b.status is Status.RUNNING and len(b.pages) == 2


def test_preemption_takes_the_newest_running_sequence_not_the_one_growing():
    sim = Sim(5, prefix_caching=False)
    a, b, c = make_seq(4, 0, max_tokens=32), make_seq(4, 1, max_tokens=32), make_seq(2, 2, max_tokens=32)
    sim.add(a, b, c)
    out = sim.step()  # admits all three (1 page each, headroom kept): 2 free
    assert [r.seq for r in out.seqs] == [a, b, c]
    sim.step()  # a, b take their second pages: 0 free
    sim.step()
    out = sim.step()  # c reaches slot 5 with no page free: c is the newest, preempts itself
    assert out.preempted == [c] and [r.seq for r in out.seqs] == [a, b]
    out = sim.step()  # c cannot come back yet (2 pages + headroom)
    assert out.preempted == [] and [r.seq for r in out.seqs] == [a, b]
    out = sim.schedule()  # a (oldest) reaches slot 9: b, the newest running, makes room
    assert out.preempted == [b]
    assert [r.seq for r in out.seqs] == [a]
    assert list(sim.sched.waiting) == [b, c]  # preempted sequences go to the front
    assert b.num_computed == 0 and b.pages == [] and b.status is Status.WAITING
    assert len(a.pages) == 3
    assert sim.sched.num_preemptions == 2


def test_preempted_sequence_goes_ahead_of_requests_already_waiting():
    sim = Sim(3, prefix_caching=False, max_num_seqs=2)
    a, b, d = make_seq(3, 0), make_seq(3, 1), make_seq(1, 2)
    sim.add(a, b, d)
    sim.step()
    assert list(sim.sched.waiting) == [d]  # max_num_seqs
    sim.step()
    out = sim.schedule()
    assert out.preempted == [b]
    assert list(sim.sched.waiting) == [b, d]


def test_prefill_with_no_pages_at_all_preempts_the_newest():
    """The prefill step's fallback (admission normally prevents it): when no running
    sequence can get pages for its chunk, the newest is preempted so the oldest can go on."""
    sim = Sim(2, prefix_caching=False)
    a, b = make_seq(8, 0), make_seq(8, 1)
    hog = make_seq(8, 9)
    assert sim.blocks.ensure_slots(hog, 8)  # the whole pool is taken
    for s in (a, b):
        s.status = Status.RUNNING
        sim.sched.running.append(s)
    out = sim.schedule()
    assert out.kind == "prefill" and out.seqs == [] and out.preempted == [b]
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b]
    assert b.status is Status.WAITING and sim.sched.num_preemptions == 1


# ---- finishing, prefix hits -----------------------------------------------------------


def test_finish_frees_pages_of_running_and_waiting_sequences():
    sim = Sim(4)
    a, b = make_seq(8, 0), make_seq(8, 1)
    sim.add(a, b)
    sim.schedule()
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b]
    sim.sched.finish(a, "stop")
    assert a.status is Status.FINISHED and a.finish_reason == "stop" and a.pages == []
    assert sim.sched.running == [] and sim.blocks.num_free_pages == 4
    sim.sched.finish(b, "abort")
    assert b.status is Status.FINISHED and not sim.sched.waiting
    assert not sim.sched.has_work()
    assert sim.schedule() is None


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_prefix_hit_recomputes_the_last_hit_page(drop_last):
    sim = Sim(16, drop_last_prefix_hit=drop_last)
    a = make_seq(13, 0, max_tokens=2)
    sim.add(a)
    sim.step()  # prefill and sample: its 3 full pages are committed
    sim.step()  # decode: a finishes; the hashed pages stay cached
    assert a.status is Status.FINISHED
    b = make_seq(13, 1, start=1000)  # same prompt
    sim.add(b)
    out = sim.schedule()
    if drop_last:
        assert b.num_computed == 8
        assert out.kind == "prefill" and ids(out) == [("r1", 5, True)]
    else:
        assert b.num_computed == 12  # 3 pages hit; the last token is always computed
        assert out.kind == "decode" and ids(out) == [("r1", 1, True)]
    assert b.pages[: b.num_computed // PS] == cached_pages(sim, 13)[: b.num_computed // PS]


def test_blocked_admission_gives_prefix_hits_back():
    sim = Sim(6)
    a = make_seq(9, 0, max_tokens=2)
    sim.add(a)
    sim.step()
    sim.step()  # a finished; its 2 full pages stay cached
    big = make_seq(12, 1, start=5000)
    sim.add(big)
    sim.step()  # big runs, holding 3 pages
    b = make_seq(13, 2, start=1000)  # shares a's 2 cached pages, needs 2 more + 1 headroom
    sim.add(b)
    sim.schedule()
    assert sim.blocks.hits == 2  # b's admission did attach a's two cached pages ...
    assert b.status is Status.WAITING and b.pages == [] and b.num_computed == 0
    cached = cached_pages(sim, 8)
    assert all(sim.blocks.ref[p] == 0 for p in cached)  # ... and gave them back to the LRU cache
    assert set(cached) <= set(sim.blocks._evictable)
    assert sim.blocks.num_free_pages == 2  # 3, less the page big's decode step took


# ---- whole runs: invariants -------------------------------------------------------------


@dataclasses.dataclass
class RunCase:
    name: str
    sim_kwargs: dict
    expect_preemptions: bool


CASES = [  # pool sizes picked so that the tight cases do preempt (and the roomy one does not)
    RunCase("plain", dict(num_pages=10, max_num_batched_tokens=24, max_prefill_chunk=16), True),
    RunCase("eagle_like", dict(num_pages=10, max_num_batched_tokens=24, max_prefill_chunk=16, lookahead=3,
                               num_drafts=3, hash_next_token=True, drop_last_prefix_hit=True), True),
    RunCase("dflash_like", dict(num_pages=10, max_num_batched_tokens=32, max_prefill_chunk=16, lookahead=4,
                                num_drafts=3), True),
    RunCase("roomy", dict(num_pages=64, max_num_batched_tokens=32, max_prefill_chunk=16, lookahead=2,
                          num_drafts=2), False),
    RunCase("mixed", dict(num_pages=10, max_num_batched_tokens=24, max_prefill_chunk=16, max_prefill_rows=2), True),
    RunCase("mixed_roomy", dict(num_pages=64, max_num_batched_tokens=12, max_prefill_chunk=8, max_prefill_rows=1),
            False),
    # mixed steps with a drafter (jspec/engine/spec_mixed.py): drafts in the decode rows'
    # tokens, lookahead reserved past both segments' rows
    RunCase("mixed_eagle_like", dict(num_pages=10, max_num_batched_tokens=24, max_prefill_chunk=16, lookahead=3,
                                     num_drafts=3, hash_next_token=True, drop_last_prefix_hit=True,
                                     max_prefill_rows=2), True),
    RunCase("mixed_dflash_like", dict(num_pages=10, max_num_batched_tokens=32, max_prefill_chunk=16, lookahead=4,
                                      num_drafts=3, max_prefill_rows=1), True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_full_run_invariants(case):
    """Many requests sharing prompt prefixes through a small pool: every step respects the
    budget and max_num_seqs, every written slot is reserved in a page of the writer's own
    (never a shared or hashed page), ref counts match the owners, and at the end every
    request has its max_tokens outputs and every page is free again."""
    sim = Sim(**case.sim_kwargs)
    cfg, bm = sim.cfg, sim.blocks
    shared = list(range(7000, 7000 + 10))
    seqs = []
    for i in range(12):
        prompt = (shared[: 4 + (i % 3) * 3] if i % 2 else []) + list(range(100 * i, 100 * i + 3 + (5 * i) % 11))
        s = Sequence(request_id=f"q{i}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=6 + i % 5),
                     seed=i, arrival=i)
        seqs.append(s)
    pending = list(seqs)
    steps = 0
    while sim.sched.has_work() or pending:
        if pending and steps % 2 == 0:  # requests keep arriving
            sim.add(pending.pop(0))
        out = sim.schedule()
        steps += 1
        assert steps < 2000, "no progress"
        if out is None:
            continue
        assert len(sim.sched.running) <= cfg.max_num_seqs
        nd = {"prefill": 0, "decode": len(out.seqs), "mixed": out.num_decode}[out.kind]
        assert all(r.sample and r.num_new == 1 + len(r.seq.draft_token_ids) for r in out.seqs[:nd])
        assert all(0 < r.num_new <= cfg.max_prefill_chunk for r in out.seqs[nd:])
        if out.kind != "decode":
            assert sum(r.num_new for r in out.seqs) <= cfg.max_num_batched_tokens
        if cfg.max_prefill_rows:
            assert len(out.seqs) - nd <= cfg.max_prefill_rows
            # every running sequence with only its last token to compute is a decode row
            assert {id(s) for s in sim.sched.running if s.num_tokens - s.num_computed == 1} <= \
                {id(r.seq) for r in out.seqs[:nd]}
        assert len({id(r.seq) for r in out.seqs}) == len(out.seqs)
        for r in out.seqs:
            s = r.seq
            assert s.status is Status.RUNNING
            assert r.sample == (s.num_computed + r.num_new >= s.num_tokens)
            end = s.num_computed + r.num_new + cfg.lookahead  # slots this step may write
            assert len(s.pages) * PS >= end
            for p in s.pages[s.num_computed // PS: -(-end // PS)]:
                assert bm.ref[p] == 1, f"{s.request_id} writes shared page {p}"
                assert p not in bm.page_hash, f"{s.request_id} writes cached page {p}"
        for p in out.preempted:
            assert p.status is Status.WAITING and p.num_computed == 0 and p.pages == []
        owners = {}
        for s in sim.sched.running:
            for p in s.pages:
                owners[p] = owners.get(p, 0) + 1
        assert all(bm.ref[p] == n for p, n in owners.items())
        assert all(bm.ref[p] == 0 for p in range(bm.num_pages) if p not in owners)
        assert bm.num_free_pages == bm.num_pages - len(owners)
        sim.apply(out)
    assert sorted(s.request_id for s in sim.finished) == sorted(s.request_id for s in seqs)
    for s in seqs:
        assert s.status is Status.FINISHED and len(s.output_token_ids) == s.params.max_tokens
    assert bm.ref == [0] * bm.num_pages and bm.num_free_pages == bm.num_pages
    assert (sim.sched.num_preemptions > 0) == case.expect_preemptions, "the case no longer (or now) preempts"
    assert bm.hits > 0  # the shared prefix was served from the cache


def test_scheduled_seq_and_output_types():
    """The step description the runner consumes."""
    sim = Sim(8)
    a = make_seq(3, 0)
    sim.add(a)
    out = sim.schedule()
    assert isinstance(out, SchedulerOutput)
    assert out.seqs == [ScheduledSeq(a, 3, True)]


# ---- mixed steps (max_prefill_rows > 0) -------------------------------------------------------


def test_mixed_step_keeps_every_decode_row_while_a_long_prompt_prefills():
    """Decode rows first (each its last token), then the long prompt's chunks in the budget
    they leave: the running streams get a token in every step of the prefill."""
    sim = Sim(64, max_num_batched_tokens=10, max_prefill_chunk=8, max_prefill_rows=2)
    a, b = make_seq(3, 0, max_tokens=50), make_seq(5, 1, max_tokens=50)
    sim.add(a, b)
    assert sim.step().kind == "prefill"  # both prompts in one step
    assert ids(sim.step()) == [("r0", 1, True), ("r1", 1, True)]
    long = make_seq(40, 2)
    sim.add(long)
    chunks = []
    while not long.output_token_ids:
        out = sim.step()
        assert out.kind == "mixed" and out.num_decode == 2 and out.preempted == []
        assert ids(out)[:2] == [("r0", 1, True), ("r1", 1, True)]
        assert [r.seq for r in out.seqs[2:]] == [long]
        chunks.append(out.seqs[2].num_new)
    assert chunks == [8] * 5  # min(max_prefill_chunk, 10 - 2 decode tokens)
    out = sim.step()
    assert out.kind == "decode" and len(out.seqs) == 3


def test_mixed_step_budget_and_prefill_rows_oldest_first():
    sim = Sim(64, max_num_batched_tokens=12, max_prefill_chunk=16, max_prefill_rows=2)
    a = make_seq(2, 0, max_tokens=50)
    sim.add(a)
    sim.step()
    b, c, d = make_seq(30, 1), make_seq(30, 2), make_seq(30, 3)
    sim.add(b, c, d)
    out = sim.schedule()
    # 1 decode token, then 11 prompt tokens for the two oldest prompts at most
    assert out.kind == "mixed" and ids(out) == [("r0", 1, True), ("r1", 11, False)]
    sim.apply(out)
    sim.sched.cfg = dataclasses.replace(sim.cfg, max_num_batched_tokens=40)
    out = sim.schedule()
    assert ids(out) == [("r0", 1, True), ("r1", 16, False), ("r2", 16, False)]  # two rows, oldest first


def test_mixed_decode_growth_preempts_a_prefilling_newcomer():
    """Decode rows keep priority: growing them preempts the newest sequence even while it
    prefills, and the step goes on without it."""
    sim = Sim(5, max_num_batched_tokens=16, max_prefill_chunk=4, max_prefill_rows=1)
    a = make_seq(4, 0, max_tokens=50)  # 1 page, grows into a 2nd at its 5th token
    sim.add(a)
    sim.step()
    late = make_seq(10, 1)  # 3 pages reserved, 1 left free
    sim.add(late)
    out = sim.step()
    assert out.kind == "mixed" and [r.seq for r in out.seqs] == [a, late]
    # a's 2nd page takes the last free one; its 3rd finds none and preempts late
    while not sim.sched.num_preemptions:
        out = sim.step()
    assert out.preempted == [late] and late.status is Status.WAITING and [r.seq for r in out.seqs] == [a]


@pytest.mark.parametrize("kw, match", [(dict(max_prefill_rows=-1), "max_num_partial_prefills"),
                                       (dict(max_prefill_rows=1, max_num_batched_tokens=8), "must exceed"),
                                       (dict(max_prefill_rows=1, max_num_batched_tokens=32, num_drafts=3),
                                        r"max_num_seqs=8 x \(1 \+ num_speculative_tokens=3\)")])
def test_mixed_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**{**dict(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=16,
                                  max_model_len=128), **kw})
