"""scripts/bench_serving.py: its workload generators, and one run against a real
``python -m jspec.serve`` it launches on the tiny default model."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # bench_serving

import bench_serving  # noqa: E402

from tests.helpers.serve import ENGINE_ARGS, jax_cache_env  # noqa: E402


def test_arrivals_poisson_and_seeded():
    rate = 4.0
    t = bench_serving.arrival_times(2001, rate, (7, 0, 1))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / rate) < 0.1 / rate
    assert np.array_equal(t, bench_serving.arrival_times(2001, rate, (7, 0, 1)))
    assert not np.array_equal(t, bench_serving.arrival_times(2001, rate, (8, 0, 1)))
    assert np.array_equal(bench_serving.arrival_times(5, math.inf, 0), np.zeros(5))


def test_length_sampler_bounds():
    rng = np.random.default_rng(0)
    xs = bench_serving.sample_lengths(5000, 100, 0.25, rng)
    assert xs.min() == 75 and xs.max() == 125  # both ends reached: uniform over [75, 125]
    assert np.array_equal(bench_serving.sample_lengths(10, 33, 0.0, rng), np.full(10, 33))
    assert bench_serving.sample_lengths(1000, 2, 0.9, rng).min() >= 1
    with pytest.raises(ValueError):
        bench_serving.sample_lengths(1, 10, 1.0, rng)
    reqs = bench_serving.make_requests(50, 20, 8, 0.5, 300, 3)
    assert all(10 <= len(r.prompt) <= 30 and 4 <= r.output_len <= 12 for r in reqs)
    assert all(0 <= t < 300 for r in reqs for t in r.prompt)
    assert reqs == bench_serving.make_requests(50, 20, 8, 0.5, 300, 3)


def test_metrics_follow_vllm():
    r = bench_serving.Result(prompt_len=4, output_len=5, success=True, output_tokens=5, ttft=0.1, e2el=0.5,
                             itl=[0.2, 0.2], chunks=3)  # 3 chunks: 1 + 2 + 2 tokens
    m = bench_serving.calculate_metrics([r, bench_serving.Result(3, 2, error="boom")], 2.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (1, 1, 5)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1)
    assert m["mean_itl_ms"] == pytest.approx(200.0)  # a chunk's gap counts once
    assert m["output_throughput"] == 2.5 and m["total_token_throughput"] == 4.5


def test_failed_requests_are_counted():
    import asyncio

    reqs = bench_serving.make_requests(3, 4, 2, 0.0, 100, 0)
    port = bench_serving._free_port()  # nothing listens there
    results, _ = asyncio.run(bench_serving.run_rate(f"http://127.0.0.1:{port}", "m", reqs, np.zeros(3), timeout=10))
    assert all(not r.success and "Connection" in r.error for r in results)
    assert bench_serving.calculate_metrics(results, 1.0)["failed"] == 3


def test_bench_against_launched_server(tmp_path, monkeypatch):
    for k, v in jax_cache_env().items():  # the launched server shares the tests' compilation cache
        monkeypatch.setenv(k, v)
    out = tmp_path / "bench.json"
    rc = bench_serving.main(["--launch", shlex.join(ENGINE_ARGS), "--rates", "8,inf", "--num-prompts", "8",
                             "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5", "--seed", "1",
                             "--json", str(out), "--launch-timeout", "120"])
    assert rc == 0
    blocks = json.loads(out.read_text())["results"]
    assert [b["request_rate"] for b in blocks] == [8.0, "inf"]
    for b in blocks:
        assert (b["completed"], b["failed"]) == (8, 0)
        reqs = b["requests"]
        assert len(reqs) == 8 and len({r["output_len"] for r in reqs}) > 1  # lengths vary
        for r in reqs:
            assert r["output_tokens"] == r["output_len"]
            assert 0 < r["ttft"] <= r["e2el"]
        assert b["total_output_tokens"] == sum(r["output_len"] for r in reqs)
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < b[f"median_{name}_ms"] <= b[f"p90_{name}_ms"] <= b[f"p99_{name}_ms"]
        assert b["spec_decode"] is None
        assert isinstance(b["compilations"], int) and b["compilations"] >= 0  # jspec's /metrics gauge, read


def test_the_bound_beside_a_served_workload():
    from bench_common import LLAMA_8B
    from bench_throughput import workload_bound

    hw = workload_bound(LLAMA_8B, 40, 1024, 256, 64, 600e12, 4.4e12)
    b = bench_serving.serving_bound(LLAMA_8B, 40, 1024, 256, 64, 4.4e12, 600e12, last_arrival=0.0)
    assert b["seconds"] == pytest.approx(hw.seconds) and b["output_tok_s"] == pytest.approx(40 * 256 / hw.seconds)
    assert 1.0 < hw.seconds < 4.0  # ~1.1 s of prefill FLOPs and ~1 s of weight and KV bytes
    # a rated run ends no sooner than its last request arrives
    assert bench_serving.serving_bound(LLAMA_8B, 40, 1024, 256, 64, 4.4e12, 600e12, 100.0)["seconds"] == 100.0
    # a launch's model and rows a step, as the server reads them (its default rows: 8)
    assert bench_serving.launch_settings("--model /m --max-num-seqs 64") == ("/m", 64)
    assert bench_serving.launch_settings("--model=/m --dtype bfloat16") == ("/m", 8)
    assert bench_serving.launch_settings("/m --max-num-seqs=16") == ("/m", 16)
    bw, peak = bench_serving.probe_device()  # this machine's device, in a child process
    assert bw > 0 and peak > 0
    with pytest.raises(SystemExit, match="range-ratio 0"):
        bench_serving.main(["--bound", "/m", "--range-ratio", "0.5"])
