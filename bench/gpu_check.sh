#!/usr/bin/env bash
# The whole GPU check in one command, for a bare CUDA machine (torch, triton, transformers, grpcio, protobuf,
# safetensors, pytest; none of the modules `python bench/gpu_image.py --list` names; no network; the project
# not installed). It runs the in-process engine from this checkout. Every stage has its own time limit and the
# limits add up to 8 minutes, Triton's compiles included, so the check fits one 10-minute call:
#
#   environment  15 s  GPU, driver, versions, gcc and pip, which of the image's missing modules are absent
#   gpu-tests   155 s  tests/gpu: kernels against references, CUDA graphs (graphs vs eager at batch 16), fused
#                      ops, memory profiling, input buffers
#   parity       80 s  bench/gpu_parity.py: bf16 greedy parity against transformers fp32 and bf16, graphs on/off
#   throughput  220 s  bench/gpu.sh, one stage per run: Llama-3.1-8B-shaped dummy weights, 1000 x 128/128
#                      (70 s graphs, 45 s eager) and 200 x 1000/1000 (60 s, 45 s), each decode step next to its
#                      HBM bound
#   summary      10 s  bench/gpu_summary.py: every verdict and figure against its target, compiled variants
#
# A stage that runs out of time is interrupted (SIGINT), so pytest still writes gpu-tests.xml; parity.json is
# rewritten after each model and each throughput run has its own file: what finished is kept.
#
#   bench/gpu_check.sh             on the GPU machine
#   bench/gpu_check.sh --dry-run   the same stages on the CPU (fp32, tiny shapes), every Python command run as
#                                  the bare image would run it (bench/gpu_image.py refuses its missing modules)
#
# Wheels the machine lacks (protobuf >= 7.35 for the generated messages; llguidance for constrained requests)
# travel in ./.whl and are installed into a private folder first when present: bench/gpu_wheels.sh fetches them.
# Results in $OUT (default bench-results/gpu-check): check.log, gpu-tests.xml, parity.json, one JSON per
# throughput run (4) and summary.txt. Exit status: 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-bench-results/gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/check.log") 2>&1
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ "$DRY_RUN" = 1 ]; then
  # Every Python command below goes through the image's import rules.
  printf '#!/bin/sh\nexec %s %s "$@"\n' "$(command -v "$PYTHON")" "$PWD/bench/gpu_image.py" > "$WORK/python"
  chmod +x "$WORK/python"
  PYTHON=$WORK/python
  DEVICE=cpu DTYPE=float32
  parity_shape=(--models qwen3 --prompts 3 --new-tokens 8)
else
  DEVICE=cuda DTYPE=bfloat16
  parity_shape=()
fi

if [ "$DRY_RUN" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${SITE:-/tmp/pagerail-site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

STAGES=$WORK/stages.tsv
: > "$STAGES"
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, record the verdict, never stop the check
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo; echo "=== $name (limit ${limit}s)"
  # SIGINT first: pytest and the scripts then write what they have; SIGKILL 10 s later if that hangs.
  timeout -s INT -k 10 "$limit" "$@"
  local rc=$?
  local verdict
  if [ $rc -eq 0 ]; then verdict=pass
  elif [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT"
  else verdict="FAIL ($rc)"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$verdict" "$((SECONDS - started))" "$limit" >> "$STAGES"
}

stage environment 15 "$PYTHON" - "$DRY_RUN" <<'PY'
import importlib.util, shutil, subprocess, sys
import torch, triton, transformers, google.protobuf
dry_run = sys.argv[1] == "1"
if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    print(subprocess.run(query, capture_output=True, text=True).stdout.strip())
else:
    print("nvidia-smi: absent")
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}, protobuf {google.protobuf.__version__}")
print("gcc:", shutil.which("gcc") or "absent", "| pip:", "present" if importlib.util.find_spec("pip") else "absent")
listed = subprocess.run([sys.executable, "bench/gpu_image.py", "--list"], capture_output=True, text=True, check=True)
names = listed.stdout.split()
present = [name for name in names if importlib.util.find_spec(name) is not None]
print(f"of the {len(names)} modules the image lacks, present here:", ", ".join(present) or "none")
from pagerail import LLM  # noqa: F401  the in-process engine imports without them
print("engine imports: ok")
assert dry_run or torch.cuda.is_available(), "no CUDA device"
PY

timeout_plugin=()
if "$PYTHON" -c 'import pytest_timeout' 2> /dev/null; then
  timeout_plugin=(--timeout 90)  # one stuck test must not take the whole stage
fi
stage gpu-tests 155 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu -o addopts="-ra" --durations 10 \
  "${timeout_plugin[@]}" --junitxml="$OUT/gpu-tests.xml"
stage parity 80 "$PYTHON" bench/gpu_parity.py --device "$DEVICE" --dtype "$DTYPE" "${parity_shape[@]}" \
  --json "$OUT/parity.json"
throughput=(env PYTHON="$PYTHON" OUT="$OUT" DRY_RUN="$DRY_RUN" MODEL_DIR="$WORK/model")
stage "throughput small graphs" 70 "${throughput[@]}" WORKLOADS=small MODES=graphs WEIGHTS=bf16 bench/gpu.sh
stage "throughput small eager" 45 "${throughput[@]}" WORKLOADS=small MODES=eager WEIGHTS=bf16 bench/gpu.sh
stage "throughput long graphs" 60 "${throughput[@]}" WORKLOADS=long MODES=graphs WEIGHTS=bf16 bench/gpu.sh
stage "throughput long eager" 45 "${throughput[@]}" WORKLOADS=long MODES=eager WEIGHTS=bf16 bench/gpu.sh
stage summary 10 "$PYTHON" bench/gpu_summary.py "$OUT" "$STAGES" 10

cut -f2 "$STAGES" | grep -qvx pass && exit 1 || exit 0
