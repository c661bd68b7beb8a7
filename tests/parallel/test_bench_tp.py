"""scripts/bench_tp.py on the 8 virtual CPU devices, tiny shapes: every section it runs on
the GPU (the all-reduce chain, plain and speculative rows with the physical ideal, the greedy
comparison across tp), so the script a multi-GPU session is lent time for runs there."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tp_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import bench_tp

    r = bench_tp.main(["--quick", "--tps", "1,2", "--batches", "1", "--methods", "eagle3", "--greedy", "6",
                       "--dtype", "float32", "--allreduce", "--label", "ci"])
    assert (tmp_path / "bench_tp_ci.json").exists()
    assert [(a["tp"], a["rows"]) for a in r["allreduce"]] == [(2, 1), (2, 32)]
    assert all(a["wall_us"] > 0 for a in r["allreduce"])
    # One random model at every tp (load_format="dummy"): tp 2's greedy tokens are tp 1's.
    assert [g["first_difference"] for g in r["greedy"]] == [[None] * 4] * 2
    rows = {(x["tp"], x["method"]): x for x in r["rows"]}
    assert set(rows) == {(1, "plain"), (1, "eagle3"), (2, "plain"), (2, "eagle3")}
    assert rows[(2, "plain")]["tp1_speedup"] > 0
    for tp in (1, 2):
        spec = rows[(tp, "eagle3")]
        assert 1.0 < spec["tau"] <= 4.0 and spec["drafter_bytes_per_device"] > 0
        assert 0 < spec["physical_ideal"] < spec["tau"]
