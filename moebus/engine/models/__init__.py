"""Model registry: builds a model + tokenizer from `smollm2`, a .gguf file, or an HF-layout directory."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from moebus.engine.loader.gguf_cache import converted_dir
from moebus.engine.loader.gguf_file import EMBEDDED_MODEL, embedded_gguf_path


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: dict
    name: str


def _build(arch: str, cfg: dict) -> nn.Module:
    if arch == "LlamaForCausalLM":
        from moebus.engine.models.llama import LlamaArgs, LlamaForCausalLM

        return LlamaForCausalLM(LlamaArgs.from_hf_config(cfg))
    if arch == "DeepseekV4ForCausalLM":
        from moebus.engine.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(cfg))
    raise ValueError(f"unsupported architecture {arch!r}")


def resolve(model: str | Path) -> Path:
    return embedded_gguf_path() if str(model) == EMBEDDED_MODEL else Path(model)


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    path = resolve(model)
    if path.suffix == ".gguf":
        path = converted_dir(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{model}: expected `smollm2`, a .gguf file or a dir with config.json")
    cfg = json.loads((path / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    arch = (cfg.get("architectures") or ["?"])[0]
    with torch.device("meta"):  # weights come from the checkpoint: skip random init
        net = _build(arch, cfg)
    net = net.to_empty(device=device).to(dtype)
    net.load_weights({k: v.to(dtype) for k, v in state.items()})
    for name, buf in net.named_buffers():
        if buf.is_meta or not torch.isfinite(buf.float()).all():
            raise RuntimeError(f"{arch}: buffer {name} must be a loaded weight or built in load_weights")
    return LoadedModel(net.eval(), cfg, str(model))
