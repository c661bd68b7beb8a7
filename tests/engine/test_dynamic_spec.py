"""Dynamic speculation's choice (jspec/engine/dynamic_spec.py), on given step times and
acceptance: the width that emits the most tokens per second, plain where drafting does not
pay, vLLM's disable_by_batch_size, and a request whose drafts are never accepted stops
drafting (one probe in probe_every)."""

from __future__ import annotations

import pytest

from jspec.engine.dynamic_spec import DynamicSpeculation, decode_widths, expected_tokens


def test_decode_widths():
    assert decode_widths(3, True, None) == (1, 2, 4)
    assert decode_widths(7, True, None) == (1, 2, 4, 8)
    assert decode_widths(15, True, None) == (1, 2, 4, 8, 16)
    assert decode_widths(5, True, None) == (1, 2, 4, 6)
    assert decode_widths(3, False, None) == (4,)
    assert decode_widths(3, False, 8) == (1, 4)


def policy(K, times, N=8, measured=False, **kw):
    """A policy with warmup's times (and as many measured, ``measured``) at batch bucket N."""
    p = DynamicSpeculation(K, decode_widths(K, True, None), True, **kw)
    p.warm = {(q, N): t for q, t in times.items()}
    for q, t in times.items() if measured else ():
        p.record_time(q, N, t)
    return p


def accept(p, rid, k, accepted, n=40):
    for _ in range(n):
        p.record_acceptance([(rid, k, accepted)])


def test_the_width_that_emits_most_per_second():
    # DFlash-like: the first five drafts always accepted, the rest never; a step's time grows
    # with its width (compute-bound at this batch)
    times = {q: 1.0 + 0.5 * q for q in (1, 2, 4, 8, 16)}
    p = policy(15, times, measured=True)
    rows = [(f"r{i}", 15, 15) for i in range(8)]
    for rid, _, _ in rows:
        accept(p, rid, 15, 5)
    # tokens per row: E(0)=1, E(1)=2, E(3)=4, E(7)=6, E(15)=6 -> per second 0.67, 1, 1.33, 1.2, 0.67
    assert expected_tokens(p.rates(["r0"]))[0, [0, 1, 3, 7, 15]] == pytest.approx([1, 2, 4, 6, 6], abs=0.2)
    q, ks = p.choose(rows, 8)
    assert q == 4 and ks == [3] * 8
    # a row near max_model_len verifies what it may
    q, ks = p.choose(rows[:7] + [("r7", 1, 15)], 8)
    assert q == 4 and ks == [3] * 7 + [1]
    # cheap wide steps (memory-bound): every draft is worth verifying... up to the last accepted one
    p = policy(15, {q: 1.0 + 0.01 * q for q in (1, 2, 4, 8, 16)}, measured=True)
    for rid, _, _ in rows:
        accept(p, rid, 15, 5)
    assert p.choose(rows, 8)[0] == 8


def test_plain_where_drafting_does_not_pay_and_a_probe_now_and_then():
    p = policy(3, {1: 1.0, 2: 1.6, 4: 1.9})
    rows = [(f"r{i}", 3, 3) for i in range(8)]
    for rid, _, _ in rows:
        accept(p, rid, 3, 0)  # tau 1.3-ish and worse: every draft rejected
    widths = [p.choose(rows, 8)[0] for _ in range(2 * p.probe_off_every)]
    assert widths.count(1) >= 2 * p.probe_off_every - 4  # two probes of two steps each
    assert 1 < len(set(widths))
    # measured acceptance moves the choice: drafts now all accepted
    for rid, _, _ in rows:
        accept(p, rid, 3, 3)
    assert p.choose(rows, 8)[0] == 4


def test_measured_times_replace_warmups():
    p = policy(3, {1: 1.0, 2: 1.2, 4: 1.4})
    rows = [("r0", 3, 3)]
    accept(p, "r0", 3, 3)
    assert p.choose(rows, 8)[0] == 4  # 4 tokens in 1.4 s
    p.record_time(4, 8, 5.0)  # context and host: the widths not measured scale with the one in use
    assert p._time(2, 8, 4) == pytest.approx(1.2 * 5.0 / 1.4)
    assert p.choose(rows, 8)[0] == 4
    p.record_time(2, 8, 1.5)  # measured: 2 tokens in 1.5 s beat 4 in 5
    assert p.choose(rows, 8)[0] == 2
    p.record_time(1, 8, 0.5)  # and plain beats both
    assert p.choose(rows, 8)[0] == 1
    p.record_time(1, 8, 50.0)  # one stall is no trend
    assert p.choose(rows, 8)[0] == 1 and p.times[(1, 8)] == 0.5
    # no warm times (a CPU without warmup): a width never measured is tried until it is
    p = DynamicSpeculation(3, (1, 2, 4), True)
    assert [p.choose(rows, 1)[0] for _ in range(3)] == [1, 1, 1]  # (compiling calls are not timed)
    for q, t in ((1, 1.0), (2, 1.1), (4, 1.2)):
        p.record_time(q, 1, t)
    accept(p, "r0", 3, 3)
    assert p.choose(rows, 1)[0] == 4


def test_disable_by_batch_size_and_fixed():
    p = DynamicSpeculation(3, decode_widths(3, False, 4), False, disable_by_batch_size=4)
    assert p.choose([("a", 3, 3)] * 3, 4) == (4, [3, 3, 3])
    assert p.choose([("a", 3, 3)] * 4, 4) == (1, [0, 0, 0, 0])
    assert p.choose([("a", 3, 3)] * 4, 4, fixed=True) == (4, [3, 3, 3, 3])  # a batch with a grammar


def test_a_mixed_steps_rows_take_the_best_known_width_and_try_nothing():
    rows = [(f"r{i}", 15, 15) for i in range(8)]
    # no time known at this batch (a CPU without warmup): every draft, nothing tried or counted
    p = DynamicSpeculation(15, decode_widths(15, True, None), True)
    assert p.choose(rows, 8, mixed=True) == (16, [15] * 8)
    assert p.current == {} and p.num_decode_steps == 0 and p.stats()["mixed_steps_by_width"] == {16: 1}
    # warmup's times: the width a decode call would take (test_the_width_that_emits_most_per_second)
    p = policy(15, {q: 1.0 + 0.5 * q for q in (1, 2, 4, 8, 16)})
    for rid, _, _ in rows:
        accept(p, rid, 15, 5)
    assert p.choose(rows, 8, mixed=True) == (4, [3] * 8)
    assert p.choose(rows[:1] + [("r1", 15, 2)], 8, mixed=True)[1] == [3, 2]  # at most the drafts a row holds
    assert p.current == {} and p.num_decode_steps == 0
    # only some widths timed: the best of those
    p.warm = {(1, 8): 1.0, (16, 8): 1.5}
    assert p.choose(rows, 8, mixed=True)[0] == 16
    # vLLM's disable_by_batch_size counts a mixed step's decode rows too
    p = DynamicSpeculation(3, decode_widths(3, False, 4), False, disable_by_batch_size=4)
    assert p.choose([("a", 3, 3)] * 4, 4, mixed=True) == (1, [0, 0, 0, 0])
    assert p.choose([("a", 3, 3)] * 3, 4, mixed=True) == (4, [3, 3, 3])


def test_a_request_whose_drafts_are_never_accepted_stops_drafting():
    p = policy(3, {1: 1.0, 2: 1.0, 4: 1.0})  # drafting costs nothing: the step keeps its width
    good, bad = ("good", 3, 3), ("bad", 3, 3)
    accept(p, "good", 3, 3)
    accept(p, "bad", 3, 0, n=p.stop_after - 1)
    assert p.choose([good, bad], 8)[1] == [3, 3]  # not yet: a run this long is not improbable enough
    accept(p, "bad", 3, 0, n=1)
    ks = [p.choose([good, bad], 8)[1] for _ in range(2 * p.probe_every)]
    assert all(k[0] == 3 for k in ks)
    assert sum(k[1] > 0 for k in ks) == 2  # one probe in probe_every
    assert p.stats()["num_decode_steps"] == 2 * p.probe_every + 1
    accept(p, "bad", 3, 1, n=1)  # a probe's hit: drafting again
    assert p.choose([good, bad], 8)[1] == [3, 3]
    p.forget("bad")  # a new request of that id starts from the engine-wide rate
    assert "bad" not in p._slots


def test_a_width_close_behind_is_timed_again_now_and_then():
    p = policy(3, {1: 1.0, 2: 1.2, 4: 1.4})
    rows = [("r0", 3, 3)]
    accept(p, "r0", 3, 3)
    p.record_time(4, 8, 1.4)
    p.record_time(2, 8, 0.75)  # 2 / 0.75 close behind 4 / 1.4
    assert [p.choose(rows, 8)[0] for _ in range(3)] == [4, 4, 4]
    p.num_decode_steps += p.refresh_every
    assert [p.choose(rows, 8)[0] for _ in range(3)] == [2, 4, 4]  # once, then back


def test_a_width_never_timed_at_a_batch_is_tried_once_when_it_might_pay():
    # warmup's times only: width 2 promises 2 / 1.1, close behind width 4's 4 / 1.9 (over 0.8 of it)
    p = policy(3, {1: 1.0, 2: 1.1, 4: 1.9})
    rows = [("r0", 3, 3)]
    accept(p, "r0", 3, 3)
    got = [p.choose(rows, 8)[0] for _ in range(3)]
    assert got == [2, 4, 4] or got == [4, 2, 4], got



def test_a_position_rarely_tried_leans_on_the_one_before():
    """A later draft position is tried only when every one before it was accepted: until
    measured it takes the position before's rate, not a trusted drafter's 1."""
    p = policy(3, {1: 1.0, 2: 1.5, 4: 2.0})
    p.record_acceptance([("a", 3, 1)])  # position 1 accepted, 2 rejected, 3 never tried
    g = p.engine_rates()
    assert g[0] == pytest.approx(1.0) and g[1] == pytest.approx(0.5) and g[2] == pytest.approx(g[1])
    for _ in range(20):  # 30% of first drafts accepted, never a second
        p.record_acceptance([(f"r{i}", 3, int(i < 3)) for i in range(10)])
    g = p.engine_rates()
    assert g[0] == pytest.approx(0.3, abs=0.05) and g[1] < 0.05 and g[2] <= g[1]
