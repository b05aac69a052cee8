#!/usr/bin/env bash
# Fetch, on a machine with package-index access, the wheels bench/gpu_check.sh installs on a bare GPU machine
# (CPython 3.12, x86-64): protobuf new enough for the generated messages, and llguidance for constrained requests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p .whl
for spec in "protobuf==$("$PYTHON" -c 'import google.protobuf as p; print(p.__version__)')" \
            "llguidance==$("$PYTHON" -c 'from importlib.metadata import version; print(version("llguidance"))')"; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
ls -l .whl
