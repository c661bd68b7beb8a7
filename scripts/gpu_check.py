"""The GPU check: what CI (CPU only) cannot see, in one device call.

    # 1. On a CPU machine with the test extra (torch, speculators): build the tiny checkpoints
    #    and the transformers references once (a few MB; carried to the GPU machine).
    python scripts/gpu_check.py --build .gpu_check
    # 2. On the GPU machine (the packages its image lacks as wheels: scripts/device_wheels.sh;
    #    JSPEC_COMMIT names the commit checked where the tree has no .git, or a stale one: the
    #    lent machine's copy kept the session's first commit; the report's code digest, which
    #    `--digest` prints at any checkout, says which code ran):
    JSPEC_COMMIT=<hash> python scripts/gpu_check.py --ckpts .gpu_check --md $OUT/gpu_check.md
    # The lines run in worker processes, their groups side by side (they are mostly
    # compilation, on the host's cores); then the performance table, alone. The report is
    # rewritten after every line. If a call's limit cuts the lines short, carry the report
    # back and go on in a second call with --resume (it keeps the report's passing lines and
    # runs the rest). --no-perf leaves the table out; --perf-only rewrites only the table's
    # section of an existing report: cp docs/gpu_check.md $OUT/ && ... --perf-only

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
  - the GPU rejection-sampling kernel == its jnp reference on seeded inputs (greedy,
    probabilistic with draft probabilities, synthetic), at a Llama-3 vocabulary;
  - LLMEngine.warmup() with a drafter, and ``python -m jspec.serve`` with a drafter
    answering one OpenAI completion with the greedy tokens;
  - a step that fails after its call took the donated caches: the engine restores them and
    finishes its requests with the greedy outputs;
  - a quick performance table (scripts/bench.py's measurements, batch 1, bf16 8B shape).

The lines are in gpu_check_lines.py (``line_table``: each line's worker group, name and
check); this file builds the checkpoints, runs the workers, the performance table and
writes the report.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import traceback

import gpu_check_lines
import numpy as np
from gpu_check_lines import ALONE, DRAFTERS, FALLBACK_PROMPT_LEN, FALLBACK_TOKENS, MOE_TOKENS, line_table

# This process shares the device with the server it starts (the serve line): without this,
# its XLA client would hold 75% of the device and the server would size its KV page pool
# from memory it cannot have.
# Its workers (below) share the device the same way; the marker tells them that the user
# had not set it, so that the server still gets XLA's default.
if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["_GPU_CHECK_PREALLOC_UNSET"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):  # ROOT: jspec and the tests package (tests.helpers)
    if p not in sys.path:
        sys.path.insert(0, p)


def build(folder: str):
    """Tiny checkpoints and the transformers references (CPU; needs torch + speculators)."""
    from tests.helpers import spec_e2e as h
    from tests.helpers.targets import build_hf_model, hf_greedy

    os.makedirs(folder, exist_ok=True)
    h._CACHE["root"] = os.path.abspath(folder)
    h.target()
    for name, _, _ in DRAFTERS:
        h.drafter(name)
    qwen = build_hf_model("qwen3")  # head_dim 24: no GPU kernel takes it
    qwen.save_pretrained(os.path.join(folder, "qwen3_hd24"))
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 384, size=FALLBACK_PROMPT_LEN)]
    refs = {"qwen3_hd24": {"prompt": prompt, "greedy": hf_greedy(qwen, prompt, FALLBACK_TOKENS)}}
    moe = build_hf_model("qwen3_moe")  # a Qwen3 mixture-of-experts target (8 experts, 2 a token)
    moe.save_pretrained(os.path.join(folder, "qwen3_moe"))
    prompts = [[int(t) for t in np.random.default_rng(5 + i).integers(3, 384, size=n)] for i, n in enumerate((7, 30))]
    refs["qwen3_moe"] = {"prompts": prompts, "greedy": [hf_greedy(moe, p, MOE_TOKENS) for p in prompts]}
    with open(os.path.join(folder, "references.json"), "w") as f:
        json.dump(refs, f)
    print(f"built {sorted(os.listdir(folder))} under {folder}")


def use_checkpoints(folder: str):
    """Point tests/helpers/spec_e2e.py at the prebuilt folders (no torch model is rebuilt)."""
    from tests.helpers import spec_e2e as h

    folder = os.path.abspath(folder)
    h._CACHE["root"] = folder
    h._CACHE["target"] = (os.path.join(folder, "target"), None)
    for name, _, _ in DRAFTERS:
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: run `python scripts/gpu_check.py --build {folder}` on a CPU machine first")
        h._CACHE[("drafter", name)] = path
    with open(os.path.join(folder, "references.json")) as f:
        return json.load(f)


class Report:
    """The lines' results in the table's order, whichever worker reports first; the report at
    ``md`` is rewritten after every line, so a run cut short by a time limit keeps what it
    checked."""

    def __init__(self, names: list[str], md: str | None = None):
        self.names = names
        self.results: dict[str, tuple[bool, str]] = {}
        self.md = md
        self.device = "unknown"
        self.jax = "unknown"

    @property
    def lines(self) -> list[tuple[str, bool, str]]:
        return [(n, *self.results[n]) for n in self.names if n in self.results]

    def resume(self, path: str):
        """--resume: keep the passing lines of an earlier run's report at ``path`` (cut short
        by a device call's time limit) and skip them in this run; failed lines run again. Its
        commit must be this run's."""
        with open(path) as f:
            text = f.read()
        commit = re.search(r"^- commit: (\S+)", text, re.M)
        if not commit or commit.group(1) != _commit():
            sys.exit(f"--resume: {path} is of commit {commit and commit.group(1)}, this tree is {_commit()}")
        for m in re.finditer(r"^\| (.+?) \| pass \| (.*) \|$", text, re.M):
            self.results[m.group(1)] = (True, m.group(2))
        for key in ("device", "jax"):  # until this run's workers say
            if m := re.search(rf"^- {key}: (.+)$", text, re.M):
                setattr(self, key, m.group(1))

    def record(self, name: str, ok: bool, detail: str):
        self.results[name] = (ok, detail)
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if self.md:
            write_md(self.md, self, [])


def run_line(fn) -> tuple[bool, str]:
    """One line in this process: (passed, detail with its time). A failed line is reported
    with its exception; the worker's other lines still run."""
    t = time.perf_counter()
    try:
        detail = fn() or ""
        ok = True
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    gc.collect()  # engines of this line (reference cycles) give their device memory back
    return ok, f"{detail} ({time.perf_counter() - t:.1f} s)"


# ---- quick performance table ------------------------------------------------------------
def perf(steps: int) -> list[dict]:
    """Batch 1, ctx 512, bf16, through LLMEngine.step (bench_common.py's engine_decode): plain
    Llama-3.1-8B, EAGLE3 K=3 at synthetic acceptance length 3.5, DFlash block 16 at 6.5
    (on the same Llama shape, to keep the call short), each beside the physical ideal
    tau * T(1) / (T(1) + drafter weight bytes / bandwidth), bandwidth probed here."""
    import bench_common as bench
    import jax
    import jax.numpy as jnp

    from jspec.checkpoint.target import target_param_spec
    from kernels_pallas.synthetic import conditional_rates, synthetic_rates_from_length

    bw = bench.measure_bandwidth(False)["best_TBps"] * 1e12
    cfg = bench.LLAMA_8B
    params = bench.random_tree(target_param_spec(cfg), jnp.bfloat16, 0)
    rng = np.random.default_rng(0)
    ctx = 512
    base = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16")
    t1, tps1, _ = bench.engine_decode(base, 1, ctx, rng, steps)
    rows = [dict(method="plain", K=0, tau=1.0, tok_s=tps1, speedup=1.0, t1_ms=t1 * 1e3, bw_TBps=bw / 1e12,
                 roofline_frac=bench.weight_bytes(params) / bw / t1)]
    for kind, K, length in (("eagle3", 3, 3.5), ("dflash", 15, 6.5)):
        # The target forward verifying K + 1 tokens against decoding one, by GPU time (what
        # the device spends; a synchronised single call's wall time adds the host's launches).
        gpu = jax.default_backend() == "gpu"
        tk = bench.target_forward_time(base, 1, ctx, rng, K + 1, gpu_time=gpu)
        tk = tk / bench.target_forward_time(base, 1, ctx, rng, 1, gpu_time=gpu)
        dc, dparams = bench.drafter_setup(kind, cfg, False)
        dbytes = bench.drafter_stream_bytes(cfg, dc, dparams)
        spec = {"method": kind, "model": f"random-{kind}", "num_speculative_tokens": K,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
        eng = bench.make_engine(cfg, params, max_num_seqs=1, ctx=ctx, dtype="bfloat16", spec=spec,
                                drafter=(dc, dparams), extra=(steps + 8) * (K + 1) + 64)
        td = bench.draft_time(eng, 1, ctx, rng, K)
        eng.runner.synthetic_rates = jnp.asarray(conditional_rates(synthetic_rates_from_length(length, K)), jnp.float32)
        _, tps, _ = bench.engine_decode(eng, 1, ctx, rng, steps)
        tau = eng.spec_metrics.mean_acceptance_length
        ideal = bench.physical_ideal(tau, t1, dbytes, bw)
        rows.append(dict(method=f"{kind} K={K}", K=K, tau=tau, tok_s=tps, speedup=tps / tps1, ideal=ideal,
                         frac_of_ideal=tps / tps1 / ideal, tk1_over_t1=tk, draft_ms=td * 1e3,
                         draft_bound_ms=dbytes / bw * 1e3, draft_over_bound=td / (dbytes / bw)))
        del eng
        jax.clear_caches()
    return rows


def perf_table(rows) -> list[str]:
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
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def write_md(path: str, report: Report, perf_lines: list[str]):
    commit = _commit()
    passed = sum(ok for _, ok, _ in report.lines)
    lines = ["# GPU check", "",
             "Written by `scripts/gpu_check.py` (see its docstring for how to run it); overwritten each run.", "",
             f"- commit: {commit}", f"- code digest (`--digest`): {code_digest()}", f"- date: {datetime.date.today().isoformat()}",
             f"- device: {report.device}", f"- jax: {report.jax}",
             f"- result: {passed} of {len(report.lines)} lines pass", "",
             "| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'pass' if ok else '**FAIL**'} | {d.replace('|', '/')} |" for n, ok, d in report.lines]
    with open(path, "w") as f:
        f.write("\n".join(lines + _perf_section(perf_lines)) + "\n")


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



# ---- the workers: each runs its group's lines of gpu_check_lines.line_table ---------------
_workers: list = []  # their processes, stopped with this one (a device call's time limit)


def _stop_workers(signum, frame):
    for p in _workers:
        if p.poll() is None:
            p.terminate()
    sys.exit(128 + signum)


MARK = "@@gpu_check "  # a worker's results on its stdout, one JSON object a line


def _emit(obj: dict):
    print(MARK + json.dumps(obj), flush=True)


def _check_backend():
    import jax

    if jax.default_backend() != "gpu" and not gpu_check_lines.cpu_smoke:
        sys.exit(f"gpu_check needs a GPU; jax's backend is {jax.default_backend()!r}")


def worker(group: str, names: list[str], perf_steps: int):
    """--worker: run ``names`` of ``group`` (or the performance table) in this process and
    report each on stdout."""
    import jax

    _check_backend()
    _emit({"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "jax": jax.__version__})
    if group == "perf":
        return _emit({"perf": perf_table(perf(perf_steps))})
    refs = use_checkpoints(gpu_check_lines.ckpts)
    for g, name, fn in line_table(refs):
        if g == group and name in names:
            ok, detail = run_line(fn)
            _emit({"name": name, "ok": ok, "detail": detail})


def spawn(group: str, names: list[str], args, rep: Report | None, lock) -> dict:
    """Run a worker process for ``group``; relay its output (each line prefixed with the
    group) and record its results. Lines it never reported (it died) are failures. Returns
    its last non-line message (the performance table's)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", group, "--ckpts", gpu_check_lines.ckpts,
           "--perf-steps", str(args.perf_steps)] + (["--cpu"] if gpu_check_lines.cpu_smoke else [])
    env = {**os.environ, "_GPU_CHECK_LINES": json.dumps(names)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    _workers.append(proc)
    last, seen = {}, set()
    for ln in proc.stdout:
        if not ln.startswith(MARK):
            print(f"[{group}] {ln}", end="", flush=True)
            continue
        msg = json.loads(ln[len(MARK):])
        with lock:
            if "name" in msg and rep is not None:
                seen.add(msg["name"])
                rep.record(msg["name"], msg["ok"], msg["detail"])
            elif "device" in msg and rep is not None:
                rep.device, rep.jax = msg["device"], msg["jax"]
            else:
                last = msg
    rc = proc.wait()
    with lock:
        for name in names:
            if name not in seen and rep is not None:
                rep.record(name, False, f"its worker ({group}) exited with code {rc} before reporting it")
    if group == "perf" and "perf" not in last:
        raise RuntimeError(f"the performance table's worker exited with code {rc}")
    return last


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
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (jnp references, no perf)")
    ap.add_argument("--digest", action="store_true", help="print this checkout's code digest (a report's header) and exit")
    ap.add_argument("--worker", metavar="GROUP", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.digest:
        return print(code_digest())
    if args.build:
        return build(args.build)
    gpu_check_lines.cpu_smoke = args.cpu
    gpu_check_lines.ckpts = os.path.abspath(args.ckpts)
    if args.worker:
        return worker(args.worker, json.loads(os.environ.get("_GPU_CHECK_LINES", "[]")), args.perf_steps)
    if args.perf_only:
        _check_backend()
        if not os.path.exists(args.md):
            sys.exit(f"--perf-only rewrites an existing report; {args.md} does not exist")
        lines = perf_table(perf(args.perf_steps))
        print("\n".join(lines), flush=True)
        return replace_perf(args.md, lines)
    # This process touches no device: the workers do, and the serve line's server sizes its
    # page pool from what the device has.
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    signal.signal(signal.SIGTERM, _stop_workers)

    table = [(g, n) for g, n, _ in line_table(use_checkpoints(gpu_check_lines.ckpts))]
    rep = Report([n for _, n in table], args.md)
    if args.resume and os.path.exists(args.md):
        rep.resume(args.md)
    todo: dict[str, list[str]] = {}
    for g, n in table:
        if (not args.only or re.search(args.only, n)) and n not in rep.results:
            todo.setdefault(g, []).append(n)
    lock = threading.Lock()
    t0 = time.perf_counter()
    if ALONE in todo:
        spawn(ALONE, todo.pop(ALONE), args, rep, lock)
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        for job in [pool.submit(spawn, g, names, args, rep, lock) for g, names in todo.items()]:
            job.result()
    print(f"lines done in {time.perf_counter() - t0:.0f} s", flush=True)
    perf_lines = []
    if not (args.no_perf or gpu_check_lines.cpu_smoke):
        try:  # alone on the device, in a process of its own
            perf_lines = spawn("perf", [], args, None, lock)["perf"]
        except Exception as e:
            traceback.print_exc()
            rep.results["quick performance table"] = (False, f"{type(e).__name__}: {e}")
            rep.names.append("quick performance table")
        print("\n".join(perf_lines), flush=True)
    write_md(args.md, rep, perf_lines)
    print(f"wrote {args.md}")
    sys.exit(0 if all(ok for _, ok, _ in rep.lines) else 1)


if __name__ == "__main__":
    main()
