#!/usr/bin/env bash
# llama.cpp's native `llama-server` (the C++ server with continuous batching; llama-cpp-python's
# Python server handles one request at a time), built with cmake from the llama.cpp tree vendored
# in the `llama-cpp-python` sdist from PyPI. Also leaves that tree's own converter
# (convert_hf_to_gguf.py, with its gguf-py) for writing GGUFs of HF checkpoints.
set -euo pipefail
. "$(dirname "$0")/common.sh"
LLAMACPP_VERSION=${LLAMACPP_VERSION:-}   # empty: the newest sdist on PyPI
SRC=${LLAMA_SRC:-$PEERS/llama-cpp-src}
mkdir -p "$PEERS"
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python${LLAMACPP_VERSION:+==$LLAMACPP_VERSION}"
  mkdir -p "$SRC"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$SRC" --strip-components=1
  rm -rf "$tmp"
fi
if [ ! -x "$LLAMA_SERVER" ]; then
  # Native CPU build (the host's AVX-512 / AVX512-BF16 kernels), OpenMP threads, no BLAS, no curl.
  cmake -S "$SRC/vendor/llama.cpp" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  cmake --build "$SRC/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
fi
"$LLAMA_SERVER" --version 2>&1 | head -2
