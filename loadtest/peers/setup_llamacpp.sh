#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server through llama-cpp-python, built from source (its sdist
# vendors llama.cpp; pip runs cmake), in its own venv; plus an F32 GGUF of the embedded SmolLM2
# (llama.cpp's own dequantize of the Q4_1 file moebus and vLLM read), so that all three peers run
# the same fp32 weights. Downloads only through pip (and apt, for missing build tools).
set -euo pipefail
. "$(dirname "$0")/common.sh"
LLAMACPP_VERSION=${LLAMACPP_VERSION:-}   # empty: the newest on PyPI
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  apt-get update && apt-get install -y build-essential cmake ninja-build
fi
mkdir -p "$PEERS"
if [ ! -x "$LLAMACPP_VENV/bin/python" ] || ! "$LLAMACPP_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
  python3.11 -m venv "$LLAMACPP_VENV"
  "$LLAMACPP_VENV/bin/pip" install -q --upgrade pip
  # Native CPU build (AVX2 on this VM), OpenMP threads; no BLAS (llama.cpp's own kernels).
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF"} \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$LLAMACPP_VENV/bin/pip" install --no-binary llama-cpp-python --no-cache-dir \
      "llama-cpp-python[server]${LLAMACPP_VERSION:+==$LLAMACPP_VERSION}"
fi
"$LLAMACPP_VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'

# F32 GGUF: llama.cpp's quantize API with output type ALL_F32 dequantizes every tensor.
if [ ! -f "$F32_GGUF" ]; then
  GGUF=$(smollm2_gguf)
  "$LLAMACPP_VENV/bin/python" - "$GGUF" "$F32_GGUF" <<'PY'
import ctypes, sys
import llama_cpp
src, dst = sys.argv[1].encode(), sys.argv[2].encode()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
params.allow_requantize = True
params.nthread = 2
rc = llama_cpp.llama_model_quantize(src, dst, ctypes.byref(params))
if rc != 0:
    sys.exit(f"llama_model_quantize failed: {rc}")
print("wrote", dst.decode())
PY
fi
ls -la "$F32_GGUF"
