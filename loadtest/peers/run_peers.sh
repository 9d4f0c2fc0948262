#!/usr/bin/env bash
# Closed-loop replay of the Azure code slice against each server in turn, freshly started each time:
#   run_peers.sh ROUND SERVER...      e.g. run_peers.sh 1 moebus vllm llamacpp
# For each server: start it (serve_<server>.sh on its own port), wait for /v1/models, send one
# warm-up request, record `uptime`, run `moebus loadtest run` into
# $RESULTS/peers-<server>-<round>/ (RESULTS defaults to moebus loadtest's own folder, out of the
# source tree: $MOEBUS_CACHE/loadtest or ~/.cache/moebus/loadtest), record `uptime` again, stop the server.
set -euo pipefail
. "$(dirname "$0")/common.sh"
ROUND=${1:?usage: run_peers.sh ROUND SERVER...}; shift
PROMPT_SEED=${PROMPT_SEED:-14}
CONCURRENCY=${CONCURRENCY:-4}
LOGS=${LOGS:-$PEERS/logs}
declare -A PORTS=([moebus]=8401 [vllm]=8402 [llamacpp]=8403)
mkdir -p "$LOGS"
RESULTS=${RESULTS:-${MOEBUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moebus}/loadtest}
cd "$REPO"

for server in "$@"; do
  port=${PORTS[$server]:?unknown server $server}
  name=peers-$server-$ROUND
  out=$RESULTS/$name
  log=$LOGS/$name.log
  echo "== $name: starting $server on :$port (log $log)"
  setsid bash "$REPO/loadtest/peers/serve_$server.sh" "$port" >"$log" 2>&1 &
  pid=$!
  trap 'kill -TERM -- -$pid 2>/dev/null || true' EXIT
  t0=$(date +%s)
  until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "$server exited; tail of $log:"; tail -30 "$log"; exit 1; fi
    if (( $(date +%s) - t0 > 900 )); then echo "$server not ready after 900 s"; exit 1; fi
    sleep 2
  done
  ready_s=$(( $(date +%s) - t0 ))
  echo "ready after ${ready_s} s; warm-up request"
  # /v1/models can answer before the engine is up (moebus: 503 until a worker registers): retry.
  until curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
      -d '{"model":"smollm2","prompt":"Warm-up: the quick brown fox","max_tokens":8}' >/dev/null; do
    if (( $(date +%s) - t0 > 900 )); then echo "$server: no warm-up answer after 900 s"; exit 1; fi
    sleep 2
  done
  echo "warm-up answered after $(( $(date +%s) - t0 )) s"
  load_before=$(uptime)
  echo "load before: $load_before"
  .venv/bin/moebus loadtest run --trace ../shared/traces/azure_code_2023.csv --url "http://127.0.0.1:$port" \
    --model smollm2 --start 400 --duration 120 --length-scale 0.05 --output-scale 1 \
    --max-input-tokens 512 --max-output-tokens 32 --concurrency "$CONCURRENCY" --prompt-seed "$PROMPT_SEED" \
    --no-progress --out "$out"
  load_after=$(uptime)
  printf 'server: %s (port %s, ready after %s s)\nload before: %s\nload after:  %s\n' \
    "$server" "$port" "$ready_s" "$load_before" "$load_after" > "$out/load.txt"
  kill -TERM -- -"$pid" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$pid" 2>/dev/null || true
  trap - EXIT
  sleep 5
done
