#!/usr/bin/env bash
# Online standard workload: `pagerail serve` on the embedded model, 16 concurrent users, with chunked
# prefill on and then off, plus a load sweep with chunked prefill on. Results land in $OUT.
# Usage: bench/online.sh        (PAGERAIL=... for the command, OUT=... for the results folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PAGERAIL=${PAGERAIL:-.venv/bin/pagerail}
OUT=${OUT:-bench-results/online}
PORT=${PORT:-8765}
NUM_REQUESTS=${NUM_REQUESTS:-64}
SWEEP=${SWEEP-1 2 4 8 16 32}  # empty: no sweep
RAMP_UP=${RAMP_UP:-0}  # seconds over which the 16 users join (0: all at once)
mkdir -p "$OUT"
workload=(--num-requests "$NUM_REQUESTS" --prompt-len 32 512 --output-len 16 256 --seed 0)

start_server() {
  "$PAGERAIL" serve --port "$PORT" --grpc-port 0 "$@" > "$OUT/server.log" 2>&1 &
  SERVER=$!
  until grep -q "ready in" "$OUT/server.log"; do
    kill -0 "$SERVER" 2> /dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
  done
}
stop_server() {
  kill -TERM "$SERVER"
  wait "$SERVER" || true
}
trap 'kill -TERM "${SERVER:-0}" 2> /dev/null || true' EXIT

for mode in on off; do
  flag=--enable-chunked-prefill
  [ "$mode" = off ] && flag=--no-enable-chunked-prefill
  start_server "$flag"
  echo "== chunked prefill $mode: 16 concurrent users"
  "$PAGERAIL" bench serve --base-url "http://127.0.0.1:$PORT" "${workload[@]}" --concurrency 16 --ramp-up "$RAMP_UP" \
    --json > "$OUT/serve-chunked-$mode.json"
  if [ "$mode" = on ] && [ -n "$SWEEP" ]; then
    echo "== sweep: concurrency $SWEEP"
    # shellcheck disable=SC2086
    "$PAGERAIL" bench sweep --base-url "http://127.0.0.1:$PORT" --num-requests 32 --prompt-len 32 512 \
      --output-len 16 128 --seed 0 --concurrencies $SWEEP --output-dir "$OUT" > "$OUT/sweep.txt"
  fi
  stop_server
done

"$(dirname "$PAGERAIL")/python" - "$OUT" <<'PY'
import json, sys
rows = []
for mode in ("on", "off"):
    r = json.load(open(f"{sys.argv[1]}/serve-chunked-{mode}.json"))
    t = r["ttft_ms"]
    rows.append(f"| {mode} | {r['completed']}/{r['completed'] + r['failed']} | {r['output_throughput']:.1f} | "
                f"{t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | {t['p99'] / t['p50']:.2f} | "
                f"{r['tpot_ms']['p50']:.0f} | {r['itl_ms']['p99']:.0f} | {r['e2e_ms']['p50']:.0f} |")
print("| chunked prefill | completed | output tok/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | p99/p50 "
      "| TPOT p50 ms | ITL p99 ms | e2e p50 ms |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
PY
[ -z "$SWEEP" ] || cat "$OUT/sweep.txt"
