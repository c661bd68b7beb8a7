"""The GPU check: what CI (CPU only) cannot see, in one device call.

    # 1. On a CPU machine with the test extra (torch, speculators): build the tiny checkpoints
    #    and the transformers references once (a few MB; carried to the GPU machine).
    python scripts/gpu_check.py --build .gpu_check
    # 2. On the GPU machine (the packages its image lacks, pytest among them, as wheels:
    #    scripts/device_wheels.sh; JSPEC_COMMIT names the commit checked where the tree has no
    #    .git, or a stale one: the lent machine's copy kept the session's first commit; the
    #    report's code digest, which `--digest` prints at any checkout, says which code ran):
    JSPEC_COMMIT=<hash> python scripts/gpu_check.py --ckpts .gpu_check --md $OUT/gpu_check.md
    # The lines run in worker processes, their groups side by side (they are mostly
    # compilation, on the host's cores); then the performance table, alone. The report is
    # rewritten after every line. If a call's limit cuts the lines short, carry the report
    # back and go on in a second call with --resume (it keeps the report's passing lines and
    # runs the rest). --no-perf leaves the table out; --perf-only rewrites only the table's
    # section of an existing report: cp docs/gpu_check.md $OUT/ && ... --perf-only
    # --cpu: a smoke run on a CPU machine (the lines that need a GPU skip; no table).

Run it whenever jspec/ or kernels_pallas/ change, and commit its docs/gpu_check.md with
the change (overwritten each run). Each line passes or fails on its own:
  - speculative greedy == plain greedy on the GPU kernels, every drafter method and layout
    (a draft model, and the n-gram method, which has no checkpoint),
    float32 and bfloat16, prefix caching on and a page pool small enough to preempt (the
    tiny target of tests/helpers/spec_e2e.py, whose drafters agree with it through a
    planted feature, so acceptance is well above 1). float32: every token equal. bfloat16:
    every token equal, or outputs part only at a near-tie (the float32 logits of the two
    tokens within NEAR_TIE_ULPS bfloat16 steps of the top logit), each one reported;
  - a head_dim (24) that the GPU kernels cannot take runs on the XLA path and matches
    transformers' greedy output;
  - FP8 checkpoints (compressed-tensors per channel; quant_method fp8 in blocks) match
    transformers on their dequantized weights, plain and with an EAGLE3 drafter;
  - the GPU rejection-sampling kernel == its jnp reference on seeded inputs (greedy,
    probabilistic with draft probabilities, synthetic), at a Llama-3 vocabulary;
  - LLMEngine.warmup() with a drafter, and ``python -m jspec.serve`` with a drafter
    answering one OpenAI completion with the greedy tokens;
  - a step that fails after its call took the donated caches: the engine restores them and
    finishes its requests with the greedy outputs;
  - a quick performance table (scripts/bench.py's measurements, batch 1, bf16 8B shape).

The lines are pytest tests marked ``gpu`` (tests/gpu/test_lines.py; the table:
tests/gpu/test_perf.py), which CI collects and skips: each marker names the line's worker
group and its name in the report, and each test records its figures with pytest's
``record_property``. This file collects them, runs each group's in a worker process
(pytest in-process, a plugin relaying each outcome to this one), and writes the report.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

# This process shares the device with the server it starts (the serve line): without this,
# its XLA client would hold 75% of the device and the server would size its KV page pool
# from memory it cannot have.
# Its workers (below) share the device the same way; the marker tells them that the user
# had not set it, so that the server still gets XLA's default.
if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["_GPU_CHECK_PREALLOC_UNSET"] = "1"
# tests/conftest.py makes the CPU jax's platform where JAX_PLATFORMS is unset (CI has no
# accelerator); "" keeps jax's own choice, the GPU, in the workers and the processes they start.
os.environ.setdefault("JAX_PLATFORMS", "")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):  # ROOT: jspec and the tests package (tests.helpers)
    if p not in sys.path:
        sys.path.insert(0, p)

ALONE = "pool"  # the group that runs first, with the device to itself (tests/gpu/test_lines.py)
PERF = "perf"  # the performance table's group: alone, after the lines
PERF_LINE = "quick performance table"


class Report:
    """The lines' results in the table's order, whichever worker reports first; the report at
    ``md`` is rewritten after every line, so a run cut short by a time limit keeps what it
    checked."""

    def __init__(self, names: list[str], md: str | None = None):
        self.names = names
        self.results: dict[str, tuple[bool | None, str]] = {}  # None: skipped
        self.md = md
        self.device = "unknown"
        self.jax = "unknown"
        self.carried_from: str | None = None  # --resume of another commit's report (the same code digest)
        self.kept_perf: list[str] = []  # --resume: that report's performance section

    @property
    def lines(self) -> list[tuple[str, bool | None, str]]:
        return [(n, *self.results[n]) for n in self.names if n in self.results]

    def resume(self, path: str):
        """--resume: keep the passing lines of an earlier run's report at ``path`` (cut short
        by a device call's time limit) and skip them in this run; failed lines run again. Its
        commit must be this run's, or its code digest this tree's (a commit that changed only
        tests, scripts or docs: the report says where its lines came from)."""
        with open(path) as f:
            text = f.read()
        commit = re.search(r"^- commit: (\S+)", text, re.M)
        digest = re.search(r"^- code digest \(`--digest`\): (\S+)", text, re.M)
        if not commit or commit.group(1) != _commit():
            if not (commit and digest and digest.group(1) == code_digest()):
                sys.exit(f"--resume: {path} is of commit {commit and commit.group(1)} and code digest "
                         f"{digest and digest.group(1)}, this tree is {_commit()}, {code_digest()}")
            self.carried_from = commit.group(1)
        if PERF_HEADING in text:
            self.kept_perf = text.split(PERF_HEADING, 1)[1].strip("\n").split("\n")
        for m in re.finditer(r"^\| (.+?) \| pass \| (.*) \|$", text, re.M):
            self.results[m.group(1)] = (True, m.group(2))
        for key in ("device", "jax"):  # until this run's workers say
            if m := re.search(rf"^- {key}: (.+)$", text, re.M):
                setattr(self, key, m.group(1))

    def record(self, name: str, ok: bool | None, detail: str):
        self.results[name] = (ok, detail)
        print(f"[{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if self.md:
            write_md(self.md, self, [])


# ---- the report ---------------------------------------------------------------------------
def perf_table(rows) -> list[str]:
    """The report's performance section (markdown lines) of tests/gpu/test_perf.py's rows."""
    p = rows[0]
    out = [f"Bandwidth probe (best of f32 copy, bf16 column sum, bf16 GEMV): {p['bw_TBps']:.2f} TB/s. "
           f"Plain decode: {p['tok_s']:.1f} tok/s, T(1) {p['t1_ms']:.2f} ms, {p['roofline_frac']:.1%} of the "
           "weight-streaming roofline.", "",
           "| method | tau | tok/s | speedup over plain | physical ideal | of ideal | forward T(K+1) / T(1), GPU time "
           "| draft time (GPU) | drafter bytes / bandwidth |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows[1:]:
        out.append(f"| {r['method']} | {r['tau']:.2f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['ideal']:.2f}x "
                   f"| {r['frac_of_ideal']:.1%} | {r['tk1_over_t1']:.2f} | {r['draft_ms']:.2f} ms "
                   f"| {r['draft_bound_ms']:.2f} ms ({r['draft_over_bound']:.2f}x) |")
    return out


def _commit() -> str:
    """The commit checked: JSPEC_COMMIT, else git's HEAD, marked when jspec/ or kernels_pallas/
    differ from it (the device machine's copy of the tree can carry a stale .git with the
    newer files as uncommitted changes: a report must not name a commit it did not run)."""
    commit = os.environ.get("JSPEC_COMMIT")
    if not commit:
        try:
            git = ["git", "-C", ROOT]
            commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            dirty = subprocess.run(git + ["status", "--porcelain", "--", "jspec", "kernels_pallas"],
                                   capture_output=True, text=True).stdout.strip()
            commit = (commit or "unknown") + (" with uncommitted changes to jspec/ or kernels_pallas/" if dirty else "")
        except OSError:
            commit = "unknown"
    return commit


def code_digest() -> str:
    """sha256 (12 hex digits) of every file under jspec/ and kernels_pallas/ (paths and bytes,
    caches left out): the code a report ran, comparable with ``--digest`` at any checkout."""
    h = hashlib.sha256()
    for top in ("jspec", "kernels_pallas"):
        # top-down, pruned and ordered in place (sorting os.walk's output would walk
        # __pycache__ before the pruning could act)
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def write_md(path: str, report: Report, perf_lines: list[str]):
    commit = _commit()
    passed = sum(ok is True for _, ok, _ in report.lines)
    skipped = sum(ok is None for _, ok, _ in report.lines)
    lines = ["# GPU check", "",
             "Written by `scripts/gpu_check.py` (see its docstring for how to run it); overwritten each run.", "",
             f"- commit: {commit}", f"- code digest (`--digest`): {code_digest()}", f"- date: {datetime.date.today().isoformat()}",
             f"- device: {report.device}", f"- jax: {report.jax}",
             f"- result: {passed} of {len(report.lines)} lines pass" + (f", {skipped} skipped" if skipped else "")]
    if report.carried_from:
        lines.append(f"- passing lines carried from the report of commit {report.carried_from} (--resume: the same "
                     f"code digest), the others run at this commit")
    lines += ["",
             "| check | result | detail |", "| --- | --- | --- |"]
    result = {True: "pass", False: "**FAIL**", None: "skipped"}
    lines += [f"| {n} | {result[ok]} | {_cell(d)} |" for n, ok, d in report.lines]
    with open(path, "w") as f:
        f.write("\n".join(lines + _perf_section(perf_lines)) + "\n")


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: no column separator, on one line."""
    return re.sub(r"\s*\n\s*", " ", text.replace("|", "/")).strip()


PERF_HEADING = "## Quick performance table (batch 1, ctx 512, bf16, random Llama-3.1-8B shape)"


def _perf_section(perf_lines: list[str]) -> list[str]:
    return ["", PERF_HEADING, ""] + perf_lines if perf_lines else []


def replace_perf(path: str, perf_lines: list[str]):
    """--perf-only: the report at ``path`` (a --no-perf run's) with its table section
    replaced by this run's, and the commit of this run beside it."""
    with open(path) as f:
        text = f.read()
    head = text.split("\n" + PERF_HEADING)[0].rstrip("\n").split("\n")
    note = [f"(the table's run: commit {_commit()}, code digest {code_digest()}, {datetime.date.today().isoformat()}, "
            "separate device call)", ""]
    with open(path, "w") as f:
        f.write("\n".join(head + _perf_section(note + perf_lines)) + "\n")




# ---- the workers: each runs its group's tests of tests/gpu in-process ----------------------
_workers: list = []  # their processes, stopped with this one (a device call's time limit)


def _stop_workers(signum, frame):
    for p in _workers:
        if p.poll() is None:
            p.terminate()
    sys.exit(128 + signum)


MARK = "@@gpu_check "  # a worker's results on its stdout, one JSON object after it to the line's end


def _emit(obj: dict):
    print(MARK + json.dumps(obj), flush=True)


def _pytest(args: list[str], plugin) -> int:
    """pytest in this process on ``args`` with ``plugin``, as the GPU check runs it: -s, the
    lines' output streams to the worker's stdout as they run (and the plugin's MARK lines are
    not captured); plain asserts, a failed line's detail is its assert's message; the
    repository's pyproject.toml (rootdir, markers) wherever this runs."""
    # Only pytest's own plugins: the GPU machine's image may carry others the lines never need.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return pytest.main(args + ["-q", "-s", "--assert=plain", "--tb=short", "-p", "no:cacheprovider",
                               "-c", os.path.join(ROOT, "pyproject.toml")], plugins=[plugin])


def collect() -> list[tuple[str, str, str]]:
    """(group, line name, pytest node id) of every test marked gpu under tests/gpu, in the
    report's order (the files' order; the performance table's last)."""
    class Collect:
        def __init__(self):
            self.found = []

        def pytest_collection_finish(self, session):
            for item in session.items:
                m = item.get_closest_marker("gpu")
                if m is not None and "line" in m.kwargs:
                    self.found.append((m.kwargs["group"], m.kwargs["line"], item.nodeid))

    c = Collect()
    rc = _pytest([os.path.join(ROOT, "tests", "gpu"), "--collect-only", "-qq"], c)
    if rc != 0 or not c.found:
        sys.exit(f"gpu_check: collecting tests/gpu failed (pytest exit code {rc})")
    return c.found


class Relay:
    """A worker's pytest plugin: each line's outcome on stdout (a MARK line) as it ends:
    passed with the detail it recorded, failed with its exception, or skipped with the
    reason; each with its time. ``names``: node id -> line name."""

    def __init__(self, names: dict[str, str]):
        self.names, self.done = names, set()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        name = self.names.get(item.nodeid)
        # One message a line: from its call, or from the setup that failed or skipped it.
        if name is None or item.nodeid in self.done or (call.when != "call" and report.passed):
            return report
        self.done.add(item.nodeid)
        props, e = dict(item.user_properties), call.excinfo
        if report.skipped:
            ok, detail = None, str(e.value) if e else "skipped"
        elif report.failed:
            ok, detail = False, f"{e.typename}: {e.value}" if e else str(report.longrepr)[-800:]
        else:
            ok, detail = True, str(props.get("detail", ""))
        msg = {"name": name, "ok": ok, "detail": f"{detail} ({call.duration:.1f} s)"}
        if ok and "perf" in props:
            msg["perf"] = props["perf"]
        _emit(msg)
        return report


def _check_backend(cpu: bool):
    import jax

    if jax.default_backend() != "gpu" and not cpu:
        sys.exit(f"gpu_check needs a GPU; jax's backend is {jax.default_backend()!r} (--cpu: a smoke run)")


def worker(args, names: dict[str, str]):
    """--worker: run the tests ``names`` (node id -> line name) in this process through
    pytest, reporting each on stdout."""
    import jax

    _check_backend(args.cpu)
    _emit({"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "jax": jax.__version__})
    ids = [os.path.join(ROOT, n) for n in names]
    _pytest([*ids, "-m", "gpu", "--gpu-ckpts", args.ckpts, "--gpu-perf-steps", str(args.perf_steps)], Relay(names))


def spawn(group: str, names: dict[str, str], args, rep: Report | None, lock) -> dict[str, dict]:
    """Run a worker process for ``group``'s tests ``names`` (node id -> line name); relay its
    output (each line prefixed with the group) and record its results in ``rep``. Lines it
    never reported (it died) are failures. Returns its messages by line name."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", group, "--ckpts", args.ckpts,
           "--perf-steps", str(args.perf_steps)] + (["--cpu"] if args.cpu else [])
    env = {**os.environ, "_GPU_CHECK_LINES": json.dumps(names)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    _workers.append(proc)
    got: dict[str, dict] = {}
    for ln in proc.stdout:
        text, mark, body = ln.partition(MARK)  # a MARK can follow pytest's progress on its line
        if text.strip() or not mark:
            print(f"[{group}] {text}", end="" if not mark else "\n", flush=True)
        if not mark:
            continue
        msg = json.loads(body)
        with lock:
            if "name" in msg:
                got[msg["name"]] = msg
                if rep is not None:
                    rep.record(msg["name"], msg["ok"], msg["detail"])
            elif "device" in msg and rep is not None:
                rep.device, rep.jax = msg["device"], msg["jax"]
    rc = proc.wait()
    with lock:
        for name in names.values():
            if name not in got:
                got[name] = {"name": name, "ok": False, "detail": f"its worker ({group}) exited with code {rc} "
                             "before reporting it"}
                if rep is not None:
                    rep.record(name, False, got[name]["detail"])
    return got


def run_perf(args, perf_ids: dict[str, str]) -> list[str]:
    """The performance table's test alone in a worker: its table's lines (raises if it failed)."""
    import threading

    msg = spawn(PERF, perf_ids, args, None, threading.Lock())[PERF_LINE]
    if not msg["ok"]:
        raise RuntimeError(("skipped: " if msg["ok"] is None else "") + msg["detail"])
    return perf_table(msg["perf"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", metavar="DIR", help="build the tiny checkpoints and references into DIR (CPU)")
    ap.add_argument("--ckpts", metavar="DIR", default=".gpu_check", help="the folder --build wrote")
    ap.add_argument("--md", default=os.path.join(ROOT, "docs", "gpu_check.md"), help="where to write the report")
    ap.add_argument("--perf-steps", type=int, default=24, help="timed steps per row of the performance table")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--perf-only", action="store_true", help="only the performance table, written into the "
                    "existing report at --md in place of its table section")
    ap.add_argument("--resume", action="store_true", help="keep the passing lines of the report at --md (a "
                    "run of this commit cut short by a time limit) and run only the others")
    ap.add_argument("--only", default="", help="run only the lines matching this regex (debugging)")
    ap.add_argument("--workers", type=int, default=8, help="worker processes at once (1: one group at a time)")
    ap.add_argument("--cpu", action="store_true", help="smoke-test the lines on CPU (those needing a GPU skip; no perf)")
    ap.add_argument("--digest", action="store_true", help="print this checkout's code digest (a report's header) and exit")
    ap.add_argument("--worker", metavar="GROUP", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.digest:
        return print(code_digest())
    if args.build:
        from tests.helpers.gpu_lines import build

        return build(args.build)
    args.ckpts = os.path.abspath(args.ckpts)
    if args.worker:
        return worker(args, json.loads(os.environ.get("_GPU_CHECK_LINES", "{}")))
    # This process touches no device: the workers do, and the serve line's server sizes its
    # page pool from what the device has.
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.gpu_lines import use_checkpoints

    signal.signal(signal.SIGTERM, _stop_workers)
    use_checkpoints(args.ckpts)  # the folders are there (a clear error before any worker starts)
    table = collect()
    perf_ids = {i: n for g, n, i in table if g == PERF}
    table = [(g, n, i) for g, n, i in table if g != PERF]
    if args.perf_only:
        if not os.path.exists(args.md):
            sys.exit(f"--perf-only rewrites an existing report; {args.md} does not exist")
        try:
            lines = run_perf(args, perf_ids)
        except (RuntimeError, KeyError) as e:
            sys.exit(f"--perf-only: no performance table: {e}")
        print("\n".join(lines), flush=True)
        return replace_perf(args.md, lines)
    rep = Report([n for _, n, _ in table], args.md)
    if args.resume and os.path.exists(args.md):
        rep.resume(args.md)
    todo: dict[str, dict[str, str]] = {}
    for g, n, i in table:
        if (not args.only or re.search(args.only, n)) and n not in rep.results:
            todo.setdefault(g, {})[i] = n
    lock = threading.Lock()
    t0 = time.perf_counter()
    if ALONE in todo:
        spawn(ALONE, todo.pop(ALONE), args, rep, lock)
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        for job in [pool.submit(spawn, g, names, args, rep, lock) for g, names in todo.items()]:
            job.result()
    print(f"lines done in {time.perf_counter() - t0:.0f} s", flush=True)
    perf_lines = rep.kept_perf if args.no_perf else []  # --resume --no-perf: the resumed report's table
    if not (args.no_perf or args.cpu):
        try:  # alone on the device, in a process of its own
            perf_lines = run_perf(args, perf_ids)
        except Exception as e:
            rep.results[PERF_LINE] = (False, f"{type(e).__name__}: {e}")
            rep.names.append(PERF_LINE)
        print("\n".join(perf_lines), flush=True)
    write_md(args.md, rep, perf_lines)
    print(f"wrote {args.md}")
    sys.exit(0 if all(ok is not False for _, ok, _ in rep.lines) else 1)


if __name__ == "__main__":
    main()
