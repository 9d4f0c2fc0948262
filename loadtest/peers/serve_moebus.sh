#!/usr/bin/env bash
# moebus, the default aggregated stack (1 worker, KV broker, kv routing), SmolLM2 fp32 from the
# embedded GGUF, 2 torch threads, $DTYPE (default float32; auto: from the CPU's flags).
# Usage: serve_moebus.sh PORT [moebus up flags...]  (runs in the foreground)
set -euo pipefail
. "$(dirname "$0")/common.sh"
PORT=${1:?usage: serve_moebus.sh PORT}
cd "$REPO"
exec .venv/bin/moebus up --host 127.0.0.1 --port "$PORT" --torch-threads "$THREADS" --dtype "${DTYPE:-float32}" "${@:2}"
