"""scripts/gpu_check.py --resume: a report's passing lines are kept for a run at its commit, or
at another commit with the same code digest (jspec/ and kernels_pallas/ unchanged: a fix to a
test line), the report then saying where they came from; its performance table kept under
--no-perf; any other report refused."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import gpu_check

    return gpu_check


def report(gpu_check, tmp_path, commit: str, digest: str) -> str:
    path = tmp_path / "gpu_check.md"
    path.write_text("\n".join([
        "# GPU check", "", f"- commit: {commit}", f"- code digest (`--digest`): {digest}",
        "- device: NVIDIA H200 (gpu)",
        "- jax: 0.11.2", "", "| check | result | detail |", "| --- | --- | --- |", "| line a | pass | 1 s |",
        "| line b | **FAIL** | AssertionError |", "", gpu_check.PERF_HEADING, "", "| a table | row |", ""]))
    return str(path)


def test_resume_across_commits_of_the_same_code(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_COMMIT", "bbbb")
    rep = gpu_check.Report(["line a", "line b"])
    rep.resume(report(gpu_check, tmp_path, "aaaa", gpu_check.code_digest()))
    assert rep.results == {"line a": (True, "1 s")} and rep.carried_from == "aaaa"
    assert rep.kept_perf == ["| a table | row |"] and rep.device == "NVIDIA H200 (gpu)"
    rep.results["line b"] = (True, "2 s")
    out = str(tmp_path / "out.md")
    gpu_check.write_md(out, rep, rep.kept_perf)
    text = open(out).read()
    assert "- commit: bbbb" in text and "carried from the report of commit aaaa" in text
    assert "2 of 2 lines pass" in text and text.rstrip().endswith("| a table | row |")
    same = gpu_check.Report(["line a"])
    same.resume(report(gpu_check, tmp_path, "bbbb", "other"))  # this commit's own report: any digest
    assert same.carried_from is None
    with pytest.raises(SystemExit, match="--resume: .* is of commit aaaa and code digest other"):
        gpu_check.Report(["line a"]).resume(report(gpu_check, tmp_path, "aaaa", "other"))
