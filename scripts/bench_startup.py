"""A server's startup: seconds from launch to a healthy ``/health``, with an empty
compilation cache and then again with the cache the first start filled (issue 57: an 8B
target with an EAGLE3 drafter, <= 60 s and <= 20 s on the H200), and the compiled programs
its log reports.

    PYTHONPATH=.:scripts python3 scripts/bench_startup.py              # 8B Llama + EAGLE3, random weights
    PYTHONPATH=.:scripts python3 scripts/bench_startup.py --method dflash   # Qwen3-8B + DFlash
    PYTHONPATH=.:scripts python3 scripts/bench_startup.py --method none --extra "--max-num-seqs 64"
    PYTHONPATH=.:scripts python3 scripts/bench_startup.py --timings   # + jax's tracing / lowering / compiling seconds

``--timings`` starts the server at ``--log-level debug`` and sums jax's own timing lines of each
start by stage and function: the step programs' (``_step_impl``, ``_forward_impl``, ...) tracing and
lowering run one after another on warmup's main thread, their compiles on its threads; other
functions are the small eager programs made on the way (2026-11-30: these bound the warmup).

The model folders are config.json only (scripts/bench_llm_folders.py; load_format dummy), so
the time is warmup's: compiling every shape the server can meet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import tempfile
import time

from bench_llm_folders import main as write_folders_main
from bench_serving import LaunchedServer


def start(args: str, cache: str, whole_log: bool = False) -> tuple[float, str]:
    """Seconds to healthy and the log of ``python -m jspec.serve ARGS`` with cache ``cache`` (its
    last 20,000 characters unless ``whole_log``)."""
    # jax's cache and jspec's (whole executables: jspec/engine/executables.py) in one fresh folder
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "xla"), JSPEC_CACHE=cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    t = time.monotonic()
    srv = LaunchedServer(args, timeout=1800)
    took = time.monotonic() - t
    log = srv.log_tail(1 << 40 if whole_log else 20000)
    srv.stop()
    return took, log


_JAX_TIMING = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation of) (?:jit\()?(\w+)\)?"
                         r"(?: for jit)? in ([0-9.]+) sec")
_STAGE = {"tracing": "trace", "jaxpr to MLIR module conversion": "lower", "XLA compilation of": "compile"}


def jax_timings(log: str) -> dict:
    """jax's debug timing lines of a log, summed: {function: {stage: [count, seconds]}}, stage
    "trace" | "lower" | "compile"; the functions with the most seconds first."""
    out: dict = {}
    for stage, fn, sec in _JAX_TIMING.findall(log):
        c = out.setdefault(fn, {}).setdefault(_STAGE[stage], [0, 0.0])
        c[0] += 1
        c[1] = round(c[1] + float(sec), 3)
    return dict(sorted(out.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3", help="the drafter (eagle3, dflash, peagle) or none")
    ap.add_argument("--extra", default="", help="more server flags")
    ap.add_argument("--timings", action="store_true", help="the server at --log-level debug: jax's tracing, lowering "
                    "and compiling seconds, summed by function")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="jspec_startup_")
    write_folders_main([root, "--method", a.method if a.method != "none" else "eagle3"])
    target = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("target-")))
    args = f"--model {target} --load-format dummy {a.extra}"
    if a.method != "none":
        spec = {"method": a.method, "model": os.path.join(root, f"drafter-{a.method}")}
        args += f" --speculative-config {shlex.quote(json.dumps(spec))}"
    if a.timings:
        args += " --log-level debug --uvicorn-log-level warning"
    cache = tempfile.mkdtemp(prefix="jspec_startup_xla_")
    out = {}
    for label in ("empty cache", "warm cache"):
        took, log = start(args, cache, whole_log=a.timings)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"startup_{a.method}_{label.split()[0]}.log"), "w") as f:
                f.write(log)
        shapes = re.findall(r"(\d+ shapes \([^)]*\))", log)
        warm = re.findall(r"warmup: [^\n]*", log)
        stages = re.findall(r"(?:target loaded|drafter loaded|engine ready) in [0-9.]+ s", log)
        out[label] = dict(seconds_to_healthy=round(took, 1), shapes=shapes[-1] if shapes else None,
                          warmup=warm[-1] if warm else None, stages=stages)
        print(f"{label}: healthy after {took:.1f} s; {out[label]['shapes']}; {stages}; {out[label]['warmup']}",
              flush=True)
        if a.timings:
            out[label]["jax_timings"] = t = jax_timings(log)
            for fn, stages_of in list(t.items())[:6]:
                print(f"  {fn}: " + ", ".join(f"{k} {n} x, {sec:.1f} s" for k, (n, sec) in stages_of.items()), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"startup_{a.method}.json"), "w") as f:
            json.dump(dict(args=args, **out), f, indent=1)


if __name__ == "__main__":
    main()
