#!/usr/bin/env bash
# llama.cpp through llama-cpp-python's OpenAI-compatible server, on the F32 GGUF of the same
# SmolLM2 weights (setup_llamacpp.sh), served as "smollm2", 2 threads for decode and prefill.
# This server runs one request at a time (it serialises requests behind a lock; no batching), and
# by default a new request ends the one streaming with a bare [DONE] (no finish_reason, no error):
# --interrupt_requests False makes it queue instead.
# Usage: serve_llamacpp.sh PORT [GGUF]  (runs in the foreground; GGUF defaults to the F32 file)
set -euo pipefail
. "$(dirname "$0")/common.sh"
PORT=${1:?usage: serve_llamacpp.sh PORT [GGUF]}
MODEL=${2:-$F32_GGUF}
# ggml's OpenMP threads spin between ops by default; on this 2-core VM (shared with other work)
# that made 2 threads ~8x slower than passive waiting (8 tokens: 2.6 s vs 0.31 s, 2026-12-03).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec "$LLAMACPP_VENV/bin/python" -m llama_cpp.server --model "$MODEL" --model_alias smollm2 \
  --host 127.0.0.1 --port "$PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
  --n_ctx 8192 --n_batch 512 --interrupt_requests False --verbose False
