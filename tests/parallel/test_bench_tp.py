"""scripts/bench_tp.py on the 8 virtual CPU devices, tiny shapes: every section it runs on
the GPU (the all-reduce chain, plain and speculative rows with the physical ideal, the greedy
comparison across tp), so the script a multi-GPU session is lent time for runs there."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tp_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import bench_tp
    from bench_common import physical_ideal

    r = bench_tp.main(["--quick", "--tps", "1,2", "--batches", "1", "--methods", "eagle3", "--greedy", "6",
                       "--dtype", "float32", "--allreduce", "--label", "ci"])
    assert (tmp_path / "bench_tp_ci.json").exists()
    assert [(a["tp"], a["rows"]) for a in r["allreduce"]] == [(2, 1), (2, 32)]
    assert all(a["wall_us"] > 0 for a in r["allreduce"])
    # One random model at every tp (load_format="dummy"): tp 2's greedy tokens are tp 1's.
    assert [g["first_difference"] for g in r["greedy"]] == [[None] * 4] * 2
    rows = {(x["tp"], x["method"]): x for x in r["rows"]}
    assert set(rows) == {(1, "plain"), (1, "eagle3"), (2, "plain"), (2, "eagle3")}
    # No timing is asserted (tiny shapes on a shared CPU: a run minus its prefill can even be
    # negative); what is checked is what each figure is made of.
    plain1, plain2 = rows[(1, "plain")], rows[(2, "plain")]
    assert plain1["tp1_speedup"] is None
    assert plain2["tp1_speedup"] == pytest.approx(plain2["tok_s"] / plain1["tok_s"])
    for tp in (1, 2):
        spec, plain = rows[(tp, "eagle3")], rows[(tp, "plain")]
        assert 1.0 < spec["tau"] <= 4.0 and spec["drafter_bytes_per_device"] > 0
        # The ideal's T(1) is the plain step at the same tp and batch, measured in the same run.
        assert spec["physical_ideal"] == pytest.approx(physical_ideal(
            spec["tau"], plain["ms_per_token_step"] / 1e3, spec["drafter_bytes_per_device"],
            r["bandwidth_TBps"] * 1e12))
