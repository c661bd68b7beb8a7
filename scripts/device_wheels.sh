#!/usr/bin/env bash
# Wheels for the lent GPU machine (no package index there; Python 3.12, x86-64): the
# packages jspec's server, the OpenAI client, gpu_check's structured line and pytest (which
# runs gpu_check's lines, tests/gpu) need that its image lacks, at the versions installed
# here. Into .whl/ (ignored by git; carried with the device tool's `carry: [".whl"]`), then
# on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.:scripts
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
names=(fastapi starlette uvicorn opentelemetry-api pydantic pydantic_core annotated-types typing-inspection
       typing_extensions openai jiter sniffio httpx2 httpcore2 truststore anyio h11 idna llguidance
       jsonschema jsonschema-specifications referencing rpds-py pytest pluggy iniconfig pygments)
specs=()
for n in "${names[@]}"; do
  v=$(python3 -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "device_wheels.sh: $n is not installed here (pip install -e '.[test,serve]' first)" >&2; exit 1; }
  specs+=("$n==$v")
done
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_34_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "${specs[@]}"
ls .whl
