#!/usr/bin/env bash
# moebus, the default aggregated stack (`moebus up`: --workers auto, KV broker, kv routing), SmolLM2
# from the embedded GGUF, $DTYPE (default float32; auto: from the CPU's flags). THREADS caps the
# torch threads a worker uses: passed as --torch-threads only when it is not the host's usable
# cores, so on a host of THREADS cores this is exactly what a plain `moebus up` runs (on 2+ cores:
# two workers sharing the cores, services/fleet_shape.py).
# Usage: serve_moebus.sh PORT [moebus up flags...]  (runs in the foreground)
set -euo pipefail
. "$(dirname "$0")/common.sh"
PORT=${1:?usage: serve_moebus.sh PORT}
cd "$REPO"
CORES=$(.venv/bin/python -c 'from moebus.platforms.cpu.cores import usable_cores; print(usable_cores())')
THREAD_ARGS=()
if [ "$THREADS" != "$CORES" ]; then THREAD_ARGS=(--torch-threads "$THREADS"); fi
exec .venv/bin/moebus up --host 127.0.0.1 --port "$PORT" "${THREAD_ARGS[@]}" --dtype "${DTYPE:-float32}" "${@:2}"
