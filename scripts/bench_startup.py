"""A server's startup: seconds from launch to a healthy ``/health``, with an empty
compilation cache and then again with the cache the first start filled (issue 57: an 8B
target with an EAGLE3 drafter, <= 60 s and <= 20 s on the H200), and the compiled programs
its log reports.

    PYTHONPATH=.:scripts python3 scripts/bench_startup.py              # 8B Llama + EAGLE3, random weights
    PYTHONPATH=.:scripts python3 scripts/bench_startup.py --method dflash   # Qwen3-8B + DFlash
    PYTHONPATH=.:scripts python3 scripts/bench_startup.py --method none --extra "--max-num-seqs 64"

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


def start(args: str, cache: str) -> tuple[float, str]:
    """Seconds to healthy and the log of ``python -m jspec.serve ARGS`` with cache ``cache``."""
    # jax's cache and jspec's (whole executables: jspec/engine/executables.py) in one fresh folder
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "xla"), JSPEC_CACHE=cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    t = time.monotonic()
    srv = LaunchedServer(args, timeout=1800)
    took = time.monotonic() - t
    log = srv.log_tail(20000)
    srv.stop()
    return took, log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3", help="the drafter (eagle3, dflash, peagle) or none")
    ap.add_argument("--extra", default="", help="more server flags")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="jspec_startup_")
    write_folders_main([root, "--method", a.method if a.method != "none" else "eagle3"])
    target = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("target-")))
    args = f"--model {target} --load-format dummy {a.extra}"
    if a.method != "none":
        spec = {"method": a.method, "model": os.path.join(root, f"drafter-{a.method}")}
        args += f" --speculative-config {shlex.quote(json.dumps(spec))}"
    cache = tempfile.mkdtemp(prefix="jspec_startup_xla_")
    out = {}
    for label in ("empty cache", "warm cache"):
        took, log = start(args, cache)
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
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"startup_{a.method}.json"), "w") as f:
            json.dump(dict(args=args, **out), f, indent=1)


if __name__ == "__main__":
    main()
