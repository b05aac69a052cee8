#!/usr/bin/env bash
# One H200: pagerail with Llama-3.1-8B-shaped random weights, two standard workloads, CUDA graphs on and off, in bf16
# and with the weights quantized to fp8 on load (and an fp8 KV cache).
#
# Reports output tokens/s and the typical decode step next to its HBM-bandwidth bound (every weight and live KV
# byte read once at 4.8 TB/s), plus the in-run matmul roofline. Results land in $OUT as JSON, one file per run.
# Usage: bench/gpu.sh   (PYTHON=... picks the interpreter, OUT=... the results folder, WORKLOADS="small long"
#                        MODES="graphs eager" and WEIGHTS="bf16 fp8 fp8kv" pick the runs (fp8: --quantization fp8;
#                        fp8kv: that and --kv-cache-dtype fp8); DRY_RUN=1: the same runs on the CPU in fp32 with
#                        a tiny model of the same family and small shapes, to try the script without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-bench-results/gpu}
HBM_GBS=${HBM_GBS:-4800}
WORKLOADS=${WORKLOADS:-"small long"}
MODES=${MODES:-"graphs eager"}
WEIGHTS=${WEIGHTS:-"bf16 fp8 fp8kv"}
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  MODEL_DIR=${MODEL_DIR:-/tmp/pagerail-llama-tiny-shape}
  device=(--device cpu --dtype float32 --kv-cache-memory-bytes 67108864 --vocab-size 512)
  small=(16 16 16); long=(4 64 64)
else
  MODEL_DIR=${MODEL_DIR:-/tmp/pagerail-llama-3.1-8b-shape}
  device=(--device cuda --dtype bfloat16 --vocab-size 128256)
  small=(1000 128 128); long=(200 1000 1000)
fi
mkdir -p "$OUT" "$MODEL_DIR" || exit 1
failed=0

# The architecture of Llama 3.1 8B (no weights: the engine fills them with --load-format dummy); a tiny one of
# the same family for a dry run.
# The config is written once: the check's four throughput stages share one MODEL_DIR (and transformers' import).
[ -f "$MODEL_DIR/config.json" ] || "$PYTHON" - "$MODEL_DIR" "$DRY_RUN" <<'PY'
import sys
from transformers import LlamaConfig

rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
if sys.argv[2] == "1":
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
else:
    shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)
LlamaConfig(
    **shape, max_position_embeddings=131072, rms_norm_eps=1e-5,
    bos_token_id=128000 % shape["vocab_size"], eos_token_id=128001 % shape["vocab_size"], tie_word_embeddings=False,
    rope_parameters=rope,
).save_pretrained(sys.argv[1])
PY
[ $? -eq 0 ] || exit 1

common=(
  --model "$MODEL_DIR" --load-format dummy "${device[@]}"
  --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 8192
  --baseline roofline --memory-bandwidth-gbs "$HBM_GBS"
)
run() {
  local name=$1; shift
  echo "== $name"
  # A failed run is reported and the others still run: each answers a different question.
  "$PYTHON" -m pagerail.cluster.cli bench throughput "${common[@]}" "$@" --json > "$OUT/$name.json" || { failed=1; return; }
  "$PYTHON" - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ours, step = r["pagerail"], r["pagerail"]["decode_step"]
print(f"output {ours['output_tokens_per_s']:.0f} tok/s, total {ours['total_tokens_per_s']:.0f} tok/s, "
      f"{ours['seconds']:.1f} s; roofline share {r['figures']['share_of_roofline']:.2f}")
print(f"decode step, {step['sequences']} sequences / {step['context_tokens']} context tokens: "
      f"{1000 * step['seconds']:.2f} ms vs HBM bound {1000 * step['memory_bound_seconds']:.2f} ms "
      f"({step['seconds'] / step['memory_bound_seconds']:.2f}x)")
PY
}
for workload in $WORKLOADS; do
  case $workload in
    small) n=${small[0]} p=${small[1]} o=${small[2]} ;;
    long) n=${long[0]} p=${long[1]} o=${long[2]} ;;
    *) echo "unknown workload $workload (small, long)" >&2; exit 2 ;;
  esac
  shape=(--num-requests "$n" --prompt-len "$p" "$p" --output-len "$o" "$o"); label=${n}x${p}x${o}
  for weights in $WEIGHTS; do
    case $weights in
      bf16) quant=() ;;
      fp8) quant=(--quantization fp8) ;;
      fp8kv) quant=(--quantization fp8 --kv-cache-dtype fp8) ;;
      *) echo "unknown weights $weights (bf16, fp8, fp8kv)" >&2; exit 2 ;;
    esac
    for mode in $MODES; do
      case $mode in
        graphs) run "$label-$weights-graphs" "${shape[@]}" "${quant[@]}" || failed=1 ;;
        eager) run "$label-$weights-eager" "${shape[@]}" "${quant[@]}" --enforce-eager || failed=1 ;;
        *) echo "unknown mode $mode (graphs, eager)" >&2; exit 2 ;;
      esac
    done
  done
done
exit $failed
