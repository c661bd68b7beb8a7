"""scripts/bench_compile.py: each warmup shape lowered and compiled in turn (largest first), and
what a compiled program calls read from its text (cuBLAS GEMMs, FP8 ones apart, custom kernels)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_and_program_calls(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.delenv("JSPEC_FP8_GEMM", raising=False)
    monkeypatch.setenv("JSPEC_COMPILATION_CACHE", "0")  # main sets it too: restored after the test
    import bench_compile

    rows = bench_compile.main(["--quick", "--limit", "2"])
    assert len(rows) == 2 and rows[0]["shape"][0] >= rows[1]["shape"][0]
    assert all(r["compile_s"] > 0 and r["cublas_gemms"] == 0 for r in rows)  # XLA:CPU calls no cuBLAS
    hlo = ('%a = (bf16[8,16]{1,0}, s8[4]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%b = bf16[8,16]{1,0} custom-call(%x, %y), custom_call_target="__cublas$gemm"\n'
           '%c = bf16[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"\n'
           '%d = bf16[8]{0} fusion(%x), kind=kLoop, calls=%f')
    assert bench_compile.program_calls(hlo) == dict(cublas_gemms=2, fp8_gemms=1, custom_kernels=1, fusions=1)
