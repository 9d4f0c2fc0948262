"""Model registry: builds a model + tokenizer from `smollm2`, a .gguf file, or an HF-layout directory."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moebus.engine.loader.gguf_file import EMBEDDED_MODEL, GGUFCheckpoint, embedded_gguf_path


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
        ckpt = GGUFCheckpoint.open(path)
        cfg, state = ckpt.hf_config(), ckpt.state_dict(dtype)
    elif (path / "config.json").exists():
        from moebus.engine.models.hf_checkpoint import read_hf_checkpoint

        cfg, state = read_hf_checkpoint(path)
    else:
        raise FileNotFoundError(f"{model}: expected `smollm2`, a .gguf file or a dir with config.json")
    arch = (cfg.get("architectures") or ["?"])[0]
    with torch.device(device):
        net = _build(arch, cfg).to(dtype)
    net.load_weights({k: v.to(dtype) for k, v in state.items()})
    return LoadedModel(net.eval(), cfg, str(model))


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
