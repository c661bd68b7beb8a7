#!/usr/bin/env bash
# Install jspec with its test references, lint, and run the whole test suite (CPU).
# `speculators` pins torchvision and older datasets; its model modules need neither, so it
# is installed without dependencies (its light ones are in the `test` extra).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test,serve]"
python3 -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python3 -m ruff check jspec kernels_pallas scripts tests  # rules: pyproject.toml [tool.ruff]
if [ "$#" -gt 0 ]; then exec python3 -m pytest -q "$@"; fi
# tests/train/ in a process of its own: after the rest of the suite in one process, XLA's
# CPU compiler (jax 0.10.2) segfaulted compiling its speculative step in 4 clean-clone runs
# of 4 (the persistent compilation cache on or off); alone, or after tests/serve/test_server.py
# only, it passes.
python3 -m pytest -q --ignore=tests/train
exec python3 -m pytest -q tests/train
