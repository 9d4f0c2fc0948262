"""Checkpoint tensors into a model's parameters: per-expert tensors stacked, every tensor checked.

HF's `save_pretrained` writes MoE experts one tensor per expert (`mlp.experts.3.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.3.w1.weight`); transformers 5's modules and a GGUF's converted
copy (loader/gguf_archs.py) hold them stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
as our MoE layers do (`w13 [E, 2I, H]`, gate rows then up rows, and `w2 [E, H, I]`, see
models/moe.py); `stack_experts` takes either. `take` and `fuse` pop named tensors (missing: named). `assign`
copies a name -> tensor map into a module's parameters and buffers and fails on the first
tensor that is unexpected, misshaped or missing, naming it, so a broken checkpoint never
half-loads.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from moebus.engine.loader.kquants import one_type
from moebus.engine.quant_linear import QuantLinear


def take(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Pops `name` out of sd; a checkpoint without it fails naming it."""
    if name not in sd:
        raise KeyError(f"missing weight {name}")
    return sd.pop(name)


def fuse(sd: dict[str, torch.Tensor], parts: list[str], into: str, shape: torch.Size | None = None) -> None:
    """Pops `parts` and stores their row concatenation as `into`; with `shape` (the fused parameter's)
    each part must be an equal row block of it, else that part is named."""
    if shape is not None:
        need = (shape[0] // len(parts), *shape[1:])
        for name in parts:
            if name in sd and tuple(sd[name].shape) != need:
                raise ValueError(f"{name}: shape {tuple(sd[name].shape)}, the config needs {need}")
    sd[into] = torch.cat([take(sd, name) for name in parts])


def stack_experts(sd: dict[str, torch.Tensor], prefix: str, gate: str, up: str, down: str,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pops `{prefix}.{e}.{gate|up|down}.weight` for e in 0..E-1, or the stacked
    `{prefix}.gate_up_proj` and `{prefix}.down_proj`, out of sd: (w13 [E, 2I, H], w2 [E, H, I])."""
    if prefix + ".gate_up_proj" in sd:
        w13, w2 = take(sd, prefix + ".gate_up_proj"), take(sd, prefix + ".down_proj")
        for name, t in ((prefix + ".gate_up_proj", w13), (prefix + ".down_proj", w2)):
            if t.dim() != 3 or t.shape[0] != num_experts:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the config has {num_experts} experts")
        return w13, w2
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.(" + "|".join(map(re.escape, (gate, up, down))) + r")\.weight")
    found: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for name in [n for n in sd if n.startswith(prefix + ".")]:
        if m := pattern.fullmatch(name):
            found[m[2]][int(m[1])] = sd.pop(name)
    for part in (gate, up, down):
        have = found.get(part, {})
        missing = [e for e in range(num_experts) if e not in have]
        if missing:
            raise KeyError(f"missing weight {prefix}.{missing[0]}.{part}.weight ({len(missing)} of {num_experts} "
                           f"experts lack {part})")
        extra = sorted(set(have) - set(range(num_experts)))
        if extra:
            raise KeyError(f"unexpected weight {prefix}.{extra[0]}.{part}.weight: the config has {num_experts} experts")
    for part in (gate, up, down):
        shapes = {tuple(t.shape) for t in found[part].values()}
        if len(shapes) != 1:
            e = next(e for e, t in found[part].items() if tuple(t.shape) != tuple(found[part][0].shape))
            raise ValueError(f"{prefix}.{e}.{part}.weight: shape {tuple(found[part][e].shape)} != "
                             f"{tuple(found[part][0].shape)} of expert 0")
    stack = {p: torch.stack([found[p][e] for e in range(num_experts)]) for p in (gate, up, down)}
    if stack[gate].shape != stack[up].shape:
        raise ValueError(f"{prefix}: {gate} {tuple(stack[gate].shape[1:])} and {up} {tuple(stack[up].shape[1:])} differ")
    return torch.cat([stack[gate], stack[up]], dim=1), stack[down]


def assign(module: nn.Module, sd: dict[str, torch.Tensor], strip: str = "model.") -> None:
    """Copies every tensor of sd (names relative to module after removing `strip`) into module's
    parameters and persistent buffers; each of those must be loaded exactly once."""
    own = module.state_dict(keep_vars=True)  # parameters and persistent buffers
    loaded: set[str] = set()
    for name, tensor in sd.items():
        key = name.removeprefix(strip)
        if key not in own:
            raise KeyError(f"unexpected weight {name}")
        if own[key].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the config needs {tuple(own[key].shape)}")
        with torch.no_grad():
            own[key].copy_(tensor)
        loaded.add(key)
    missing = sorted(set(own) - loaded)
    if missing:
        raise KeyError(f"missing weight {strip}{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))



def quant_linear_of(names: list[str], quantized: dict[str, tuple[str, torch.Tensor]], in_features: int,
                    activation_bits: int | None, device: torch.device | str = "cpu") -> QuantLinear | None:
    """A QuantLinear on the GGUF blocks of `names` (its row blocks, in order; in different types all
    as Q8_0, loader/kquants.one_type), or None when one of them is not quantized."""
    parts = [quantized.get(n) for n in names]
    if any(p is None for p in parts):
        return None
    parts = [(q, torch.as_tensor(b)) for q, b in one_type([(q, b.numpy()) for q, b in parts])]
    blocks = torch.cat([p[1] for p in parts]).to(device)
    return QuantLinear(blocks, parts[0][0], in_features, activation_bits=activation_bits)


def quantize_linear(parent: nn.Module, attr: str, names: list[str], quantized: dict[str, tuple[str, torch.Tensor]],
                    sd: dict[str, torch.Tensor], activation_bits: int | None) -> bool:
    """Replaces the bias-free linear `parent.attr` by a QuantLinear on the GGUF blocks of `names`
    (quant_linear_of) when all of them are quantized, popping their dense copies from sd; else
    leaves it dense. Returns whether it did."""
    layer = getattr(parent, attr)
    if getattr(layer, "bias", None) is not None:
        return False
    q = quant_linear_of(names, quantized, layer.in_features, activation_bits, layer.weight.device)
    if q is None:
        return False
    setattr(parent, attr, q)
    for n in names:
        sd.pop(n, None)
    return True


def quantize_head(model: nn.Module, quantized: dict[str, tuple[str, torch.Tensor]], sd: dict[str, torch.Tensor],
                  activation_bits: int | None) -> None:
    """model.lm_head on its GGUF blocks; a tied head (lm_head None) on the embedding's blocks (the
    dense embedding stays for lookups)."""
    if model.lm_head is not None:
        quantize_linear(model, "lm_head", ["lm_head.weight"], quantized, sd, activation_bits)
    elif "model.embed_tokens.weight" in quantized:
        qtype, blocks = quantized["model.embed_tokens.weight"]
        emb = model.embed_tokens.weight
        model.lm_head = QuantLinear(blocks.to(emb.device), qtype, emb.shape[1], activation_bits=activation_bits)
