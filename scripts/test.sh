#!/usr/bin/env bash
# Install jspec with its test references, lint, and run the whole test suite (CPU).
# `speculators` pins torchvision and older datasets; its model modules need neither, so it
# is installed without dependencies (its light ones are in the `test` extra).
set -euo pipefail
cd "$(dirname "$0")/.."
# --no-compile: pip byte-compiles every file of every package (torch's thousands), 45 of the
# install's 83 s on the 2-core machine (2026-11-29, wheels cached); Python compiles the few
# modules the tests import as they import them (about a second).
python3 -m pip install -q --no-compile -e ".[test,serve]"
python3 -m pip install -q --no-compile --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python3 -m ruff check jspec kernels_pallas scripts tests  # rules: pyproject.toml [tool.ruff]
if [ "$#" -gt 0 ]; then exec python3 -m pytest -q "$@"; fi
# One pytest process per group of test folders: XLA's CPU compiler (jax 0.10.2) crashed
# after many compilations in one process, each time inside backend_compile_and_load, on a
# test that passes alone: a segfault compiling tests/train's speculative step after the rest
# of the suite (4 clean-clone runs of 4, 2026-11-24), an abort in tests/e2e/test_spec_warmup.py
# after a third of the suite (2026-11-25). Fewer executables per process, same tests.
# tests/parallel must be a process of its own anyway: its conftest gives jax 8 virtual CPU
# devices (XLA_FLAGS, read when jax starts). The end-to-end files compile the most step
# variants: one process each (the e2e folder in one process also died inside XLA's CPU
# compiler, 2026-11-25).
# The processes run JSPEC_TEST_JOBS at a time (default: the CPU count, at most 4), longest
# first: the suite is mostly XLA's CPU compiler, one core a compile, so two processes on the
# 2-core CI machine take little more than half the time of one after the other.
# One persistent compilation cache for this run's pytest processes (and the servers they
# start): a shape compiled in one process is loaded, not compiled again, in the next. Fresh
# per run, so every run still compiles each shape once.
# --durations: each process prints its slowest tests, to keep the run under its 30 minutes.
# XLA's CPU backend at LLVM optimization level 0: the suite is mostly compilation, and the
# same semantics compile faster; the programs run slower. A clean-clone run took 2010 s with
# it everywhere, 2403 s without (2026-11-29): tests/engine 339 -> 238 s, the spec warmup 232
# -> 158, tests/parallel 643 -> 501, but the two files that mostly run programs slowed down
# (the family's trained acceptance 283 -> 347, structured outputs 306 -> 357): those keep
# XLA's default (RUN_BOUND). The same processes also take XLA's older CPU fusion emitters
# (--xla_cpu_use_fusion_emitters=false), which compile faster (2026-12-01, one process on this
# 2-core machine, a fresh cache each: tests/kernels/test_fused_linear.py 87 -> 47 s,
# tests/e2e/test_spec_lossless.py 62 -> 50 s) but whose programs run slower (structured outputs,
# run-bound, 73 -> 109 s: not there). Appended to the caller's flags (tests/parallel's conftest
# appends its own).
export RUN_BOUND="tests/e2e/test_family.py tests/e2e/test_structured_outputs.py"
# The emitters' flag only where this jaxlib knows it (XLA aborts on an unknown flag; jax 0.10.2 does).
FAST_COMPILE="--xla_backend_optimization_level=0"
if XLA_FLAGS="--xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu \
    python3 -c "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()" > /dev/null 2>&1; then
  FAST_COMPILE="$FAST_COMPILE --xla_cpu_use_fusion_emitters=false"
fi
export FAST_COMPILE
echo "scripts/test.sh: the compile-bound processes add XLA_FLAGS $FAST_COMPILE"
export XLA_FLAGS_CALLER="${XLA_FLAGS:-}"
cache_dir=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$cache_dir" "$logs"' EXIT
export JAX_COMPILATION_CACHE_DIR="$cache_dir" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.1
# tests/gpu: the GPU check's lines, collected and skipped here (scripts/gpu_check.py runs them).
groups=("tests/kernels tests/config tests/checkpoint tests/models tests/drafters tests/gpu" "tests/engine"
        "tests/serve" "tests/train" "tests/parallel")
for dir in tests/*/; do  # a new test folder must join a group, or CI would never run it
  dir=${dir%/}
  [ "$dir" = tests/helpers ] || [ "$dir" = tests/__pycache__ ] || [ "$dir" = tests/e2e ] \
    || [[ " ${groups[*]} " == *" $dir "* ]] || { echo "scripts/test.sh: $dir is in no group" >&2; exit 1; }
done
# Longest first (seconds on this 2-core machine, 2026-12-01, a 1,404 s clean-clone run: group 0 460,
# tests/parallel 330, the family 195, tests/serve 152, tests/engine 129, compile closure 118, spec
# warmup 108, newcomer 106, structured outputs 100, the rest of the e2e files and tests/train 21-77):
# two workers finish together when the last jobs are short.
jobs=("${groups[0]}" "tests/parallel" "tests/e2e/test_family.py" "tests/serve" "tests/engine"
      "tests/e2e/test_compile_closure.py" "tests/e2e/test_spec_warmup.py" "tests/e2e/test_newcomer.py"
      "tests/e2e/test_structured_outputs.py" "tests/e2e/test_executables.py" "tests/train")
for f in tests/e2e/test_*.py; do
  [[ " ${jobs[*]} " == *" $f "* ]] || jobs+=("$f")
done
run_job() {  # one pytest process; its output printed whole when it ends (one job's at a time)
  local log rc=0 t0=$SECONDS
  log="$logs/$(echo "$1" | tr ' /' '__').log"
  local flags="$XLA_FLAGS_CALLER"
  [[ " $RUN_BOUND " == *" $1 "* ]] || flags="$flags $FAST_COMPILE"
  # shellcheck disable=SC2086
  XLA_FLAGS="$flags" python3 -m pytest -q --durations=5 $1 > "$log" 2>&1 || rc=$?
  {
    flock 9
    if [ "$rc" = 0 ]; then echo "== ok: $1 ($((SECONDS - t0)) s)"; else echo "== FAILED (exit $rc): $1 ($((SECONDS - t0)) s)"; fi
    cat "$log"
  } 9> "$logs/print.lock"
  return "$rc"
}
export -f run_job
export logs
n=${JSPEC_TEST_JOBS:-$(python3 -c "import os; print(min(os.cpu_count() or 1, 4))")}
printf '%s\n' "${jobs[@]}" | xargs -P "$n" -I{} bash -c 'run_job "$@"' _ {}
