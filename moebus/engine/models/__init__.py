"""Model registry: builds a model + tokenizer from `smollm2`, a .gguf file, or an HF-layout directory."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from moebus import platforms
from moebus.engine.loader.gguf_cache import converted_dir, quantized_blocks
from moebus.text.gguf import EMBEDDED_MODEL, embedded_gguf_path


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
    if arch in MOE_DECODERS:
        from moebus.engine.models.moe_decoder import MoEDecoderArgs, MoEDecoderForCausalLM

        return MoEDecoderForCausalLM(MoEDecoderArgs.from_hf_config(cfg))
    if arch in MLA_DECODERS:
        from moebus.engine.models.deepseek_v2 import DeepseekV2Args, DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM(DeepseekV2Args.from_hf_config(cfg))
    raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")


# Kept here rather than imported so naming the supported set does not import every model.
MOE_DECODERS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM")
MLA_DECODERS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV4ForCausalLM", *MOE_DECODERS, *MLA_DECODERS)
QUANTIZED_ARCHS = ("LlamaForCausalLM", *MOE_DECODERS, *MLA_DECODERS)  # the families weight_format "gguf" serves


# Vision-language checkpoints whose text model is a Llama under this prefix (the vision side loads
# through engine.vision.idefics3_load).
_VLM_TEXT_PREFIX = {"Idefics3ForConditionalGeneration": "model.text_model.",
                    "SmolVLMForConditionalGeneration": "model.text_model."}


def _text_model_of(cfg: dict, state: dict[str, torch.Tensor], prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The text model of a VLM checkpoint: its text_config and its tensors under Llama names."""
    text = dict(cfg["text_config"])
    if text.get("model_type", "llama") != "llama":
        raise ValueError(f"unsupported text model {text.get('model_type')!r} in a vision-language checkpoint")
    rope = text.get("rope_parameters") or {}
    if "rope_theta" not in text and rope:  # transformers 5 nests it
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {rope.get('rope_type')!r}")
        text["rope_theta"] = rope["rope_theta"]
    own = {"model." + k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if "lm_head.weight" in state:
        own["lm_head.weight"] = state["lm_head.weight"]
    text["tie_word_embeddings"] = "lm_head.weight" not in own  # what the file holds decides
    text["architectures"] = ["LlamaForCausalLM"]
    return text, own


def resolve(model: str | Path) -> Path:
    return embedded_gguf_path() if str(model) == EMBEDDED_MODEL else Path(model)


WEIGHT_FORMATS = ("dense", "gguf")


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weight_format: str = "dense", activation_bits: int | None = 16) -> LoadedModel:
    """weight_format: "dense" dequantizes a GGUF's weights to `dtype`; "gguf" serves its Q4_0/Q4_1/
    Q8_0 linear layers from the file's blocks (engine.quant_linear.QuantLinear, with activation_bits)
    and, for the MoE families, their routed experts (models/quant_experts.py); QUANTIZED_ARCHS only."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, not {weight_format!r}")
    path = resolve(model)
    quantized = None
    if path.suffix == ".gguf":
        if weight_format == "gguf":
            quantized = quantized_blocks(path)
        path = converted_dir(path)
    elif weight_format == "gguf":
        raise ValueError(f"{model}: weight_format 'gguf' needs a .gguf model")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{model}: expected `smollm2`, a .gguf file or a dir with config.json")
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if quantized is not None and arch not in QUANTIZED_ARCHS:
        raise ValueError(f"{model}: weight_format 'gguf' (quantized blocks) serves {', '.join(QUANTIZED_ARCHS)}, "
                         f"not {arch}; use weight_format 'dense'")
    # a quantized layer's experts are read only as blocks: their dense copy is GBs on a real MoE
    skip = {k for k, (_, b) in (quantized or {}).items() if b.dim() == 3}
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            state.update({k: st.get_tensor(k) for k in st.keys() if k not in skip})
    if not state:
        raise FileNotFoundError(f"{model}: no *.safetensors weights in {path}")
    if arch in _VLM_TEXT_PREFIX:
        cfg, state = _text_model_of(cfg, state, _VLM_TEXT_PREFIX[arch])
        arch = "LlamaForCausalLM"
    with torch.device("meta"):  # weights come from the checkpoint: skip random init
        net = _build(arch, cfg)
    net = net.to_empty(device=device).to(dtype)
    if hasattr(net, "decode_fast_path"):  # the device's batch-1 decode step, if it has one for this model
        net.decode_fast_path = platforms.current(device).decode_fast_path(net)
    if quantized:
        net.load_weights({k: v.to(dtype) for k, v in state.items()}, quantized=quantized,
                         activation_bits=activation_bits)
    else:
        net.load_weights({k: v.to(dtype) for k, v in state.items()})
    for name, buf in net.named_buffers():
        if buf.is_meta or not torch.isfinite(buf.float()).all():
            raise RuntimeError(f"{arch}: buffer {name} must be a loaded weight or built in load_weights")
    return LoadedModel(net.eval(), cfg, str(model))
