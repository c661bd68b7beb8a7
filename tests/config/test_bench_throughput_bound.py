"""scripts/bench_throughput.py's hardware bound against a count made token by token."""

import dataclasses
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import bench_common
    import bench_throughput

    return bench_common, bench_throughput


def _by_hand(c, n, inp, out, max_seqs, peak, bw):
    H, L, q, kv = c.hidden_size, c.num_layers, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    mats = {"q": H * q, "k": H * kv, "v": H * kv, "o": q * H, "gate": H * c.intermediate_size,
            "up": H * c.intermediate_size, "down": c.intermediate_size * H}
    flops = 0
    for _ in range(n):
        for p in range(inp):  # each prompt token through every layer's matrices and its causal attention
            flops += L * (2 * sum(mats.values()) + 2 * 2 * q * (p + 1))
        flops += 2 * c.vocab_size * H  # the lm_head at the last prompt token: the first new token
    nbytes = 0
    left = n
    while left:
        rows = min(max_seqs, left)
        left -= rows
        for j in range(1, out):  # decode step j: the weights once, each row's inp + j tokens of K and V
            nbytes += 2 * (L * sum(mats.values()) + c.vocab_size * H)
            nbytes += rows * (inp + j) * 2 * L * kv * 2
    return flops / peak, nbytes / bw


def test_the_bound_counts_each_token_and_step(bench):
    common, bt = bench
    c = dataclasses.replace(common.TINY, num_layers=3)
    for n, inp, out, s in ((5, 7, 4, 2), (4, 3, 6, 4), (1, 9, 2, 8)):
        b = bt.workload_bound(c, n, inp, out, s, peak_flops=1e9, bw=1e8)
        pf, dec = _by_hand(c, n, inp, out, s, 1e9, 1e8)
        assert abs(b.prefill_s - pf) < 1e-9 * pf and abs(b.decode_s - dec) < 1e-9 * dec


def test_the_issue_workload_on_an_h200(bench):
    """512 x (1,024 -> 256), 8B, 256 at a time, 790 TFLOP/s and 4.4 TB/s: ~9.4 s of prefill
    and ~6.2 s of decode (the issue's rough count: ~10.8 + ~6.4)."""
    common, bt = bench
    b = bt.workload_bound(common.LLAMA_8B, 512, 1024, 256, 256, 790e12, 4.4e12)
    assert 9.0 < b.prefill_s < 10.0 and 5.9 < b.decode_s < 6.5


def test_settle_waits_for_warmups_writer(bench):
    """bench_common.settle joins the thread warmup writes its executables on (its name:
    jspec/engine/warmup.py WRITER_THREAD), so that timed runs do not share the host with it."""
    import threading
    import time

    from jspec.engine.warmup import WRITER_THREAD

    bench_common, _ = bench
    writer = threading.Thread(target=time.sleep, args=(0.3,), name=WRITER_THREAD)
    writer.start()
    bench_common.settle()
    assert not writer.is_alive()


def test_read_waits_split_each_width(bench):
    """ReadWaits times every read by the width of the call it reads: the wait inside it and
    the interval since the read before returned (a call's share of the wall clock)."""
    import time

    _, bt = bench

    class Runner:
        def read(self, out, n, steps, q=None):
            time.sleep(out)
            return out

    r = Runner()
    waits = bt.ReadWaits(r)
    for i, (out, q) in enumerate([(0.0, None), (0.02, 2), (0.02, 2), (0.005, 1)]):
        r.read(out, 4, 1, q) if i % 2 else r.read(out, 4, steps=1, q=q)  # q positional or by name
        time.sleep(0.01)  # the host's own work between reads
    by = waits.by_width()
    assert list(by) == [1, 2] and by[2][0] == 2 and by[1][0] == 1  # the first read has no interval
    assert 19 <= by[2][2] < 40 and by[2][1] >= by[2][2] + 9  # waited 20 ms; 10 ms of host work besides
    assert 4 <= by[1][2] < 20
    assert [q for q, _, _ in waits.sequence] == [2, 2, 1]  # every read after the first, in order
    assert all(between >= waited for _, between, waited in waits.sequence)
    waits.close()
    assert r.read(0.0, 1, 1) == 0.0 and waits.calls == 4
