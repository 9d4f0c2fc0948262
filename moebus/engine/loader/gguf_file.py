"""Read a GGUF (the architectures of loader/gguf_archs.py): config, dequantized HF-named weights, tokenizer
metadata (its torch-free side, the embedded model's path among it: moebus/text/gguf.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from moebus.engine.loader.gguf_archs import MODEL_TYPES, GGUFArch, arch_of, hf_name, stack_experts
from moebus.engine.loader.kquants import TRANSCODED, one_type, transcode
from moebus.text.gguf import read_metadata

# GGUF types served as blocks: the kernels' own (kernels/quant_matmul.py) and those rewritten into
# one of them at load (loader/kquants.py)
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")
QUANT_TYPES = (*KERNEL_TYPES, *TRANSCODED)
_EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a layer's expert tensors (3-D)


@dataclass(slots=True)
class GGUFCheckpoint:
    metadata: dict[str, object]
    reader: GGUFReader

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        reader = GGUFReader(str(path))
        return cls(read_metadata(reader), reader)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch(self, key: str, default: object = None) -> object:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def hf_config(self) -> dict[str, object]:
        """The HF config fields this file describes (loader/gguf_archs.py maps each architecture)."""
        arch = arch_of(self.architecture)
        names = {t.name for t in self.reader.tensors}
        n_heads = int(self.arch("attention.head_count"))
        hidden = int(self.arch("embedding_length"))
        head_dim = self.arch("attention.key_length") or self.arch("rope.dimension_count") or hidden // n_heads
        hf_arch = arch.hf_architecture(self.arch)
        return {
            "architectures": [hf_arch],
            "model_type": MODEL_TYPES[hf_arch],  # what transformers' Auto classes read
            "vocab_size": int(self.arch("vocab_size", len(self.metadata["tokenizer.ggml.tokens"]))),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch("feed_forward_length")),
            "num_hidden_layers": int(self.arch("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(self.arch("attention.head_count_kv", n_heads)),
            "head_dim": int(head_dim),
            "hidden_act": "silu",
            "rms_norm_eps": float(self.arch("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch("context_length")),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            **arch.config(self.arch),
        }

    def state_dict(self, dtype: torch.dtype = torch.float32,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
        """Dequantized weights under HF names, q/k rows un-permuted back to HF's rotary layout where
        the converter permuted them, experts stacked; progress(tensors done, total) after each."""
        cfg, arch = self.hf_config(), arch_of(self.architecture)
        out: dict[str, torch.Tensor] = {}
        for k, t in enumerate(self.reader.tensors):
            if progress is not None:
                progress(k, len(self.reader.tensors))
            w = dequantize(t.data, t.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
            name = hf_name(arch, t.name)
            w = self._unpermuted(arch, name, w, cfg)
            out[name] = torch.from_numpy(np.array(w, copy=True)).to(dtype)
        stack_experts(arch, out)
        if progress is not None:
            progress(len(self.reader.tensors), len(self.reader.tensors))
        return out

    @staticmethod
    def _unpermuted(arch: GGUFArch, name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
        if arch.permuted_qk and name.endswith("self_attn.q_proj.weight"):
            return _unpermute(w, int(cfg["num_attention_heads"]))
        if arch.permuted_qk and name.endswith("self_attn.k_proj.weight"):
            return _unpermute(w, int(cfg["num_key_value_heads"]))
        return w

    def quantized_blocks(self) -> dict[str, tuple[str, torch.Tensor]]:
        """HF name -> (type, uint8 blocks) for the tensors stored in a type the quant_matmul kernels
        take (Q4_0, Q4_1, Q8_0; Q4_K rewritten as Q4_1, Q6_K / Q5_K as Q8_0 by loader/kquants.py): 2-D
        ones [rows, blocks bytes] with q/k rows un-permuted as in state_dict (a row's blocks move with
        it), and a layer's experts [E, rows, blocks bytes] stacked under the names state_dict gives
        them when all three are quantized (gate and up in one type, as kquants.one_type makes them;
        down in its own)."""
        cfg, arch = self.hf_config(), arch_of(self.architecture)
        out: dict[str, tuple[str, torch.Tensor]] = {}
        experts: dict[str, tuple[str, torch.Tensor]] = {}
        for t in self.reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in QUANT_TYPES or len(t.shape) not in (2, 3):
                continue
            name = hf_name(arch, t.name)
            qtype, w = transcode(qtype, np.asarray(t.data, dtype=np.uint8))
            if len(t.shape) == 3:
                if name.endswith(_EXPERT_STACKS):
                    experts[name] = (qtype, torch.from_numpy(np.array(w, copy=True)))
                continue
            w = self._unpermuted(arch, name, w, cfg)
            out[name] = (qtype, torch.from_numpy(np.array(w, copy=True)))
        for p in sorted({n.rsplit(".", 1)[0] for n in experts}):
            parts = [experts.get(f"{p}.{part}") for part in _EXPERT_STACKS]
            if any(x is None for x in parts):
                continue  # a part in a type no kernel takes: the layer's experts are served dense
            (gate_type, gate), (_, up) = one_type([(q, b.numpy()) for q, b in parts[:2]])
            down_type, down = parts[2]
            stacked = {f"{p}.ffn_gate_exps": torch.as_tensor(gate), f"{p}.ffn_up_exps": torch.as_tensor(up),
                       f"{p}.ffn_down_exps": down}
            stack_experts(arch, stacked)  # -> the family's gate|up and down names (arch.stacked)
            out.update({n: (down_type if n.endswith(arch.stacked[1]) else gate_type, b) for n, b in stacked.items()})
        return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves; HF keeps them as two halves.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


__all__ = ["GGUFCheckpoint", "GGUFValueType", "KERNEL_TYPES", "QUANT_TYPES"]
