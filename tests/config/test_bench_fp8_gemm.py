"""scripts/bench_fp8_gemm.py's three products agree with the float32 product of the quantized
weight: the weight-only FP8 dot to bf16's rounding, W8A8 to e4m3's rounding of the activations
(3 mantissa bits: a few percent of the largest output, far more than bf16's)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_errors(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    monkeypatch.delenv("OUT", raising=False)
    import bench_fp8_gemm

    (row,) = bench_fp8_gemm.main(["--quick"])
    assert row["bf16"]["rel_err"] < 1e-2 and row["w8a16"]["rel_err"] < 1e-2
    assert 2e-3 < row["w8a8"]["rel_err"] < 6e-2  # the activations' e4m3 rounding shows, and stays bounded
