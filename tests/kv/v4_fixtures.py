"""A tiny random DeepSeek-V4 (sliding, CSA and HCA layers) for the KV transfer and tier tests, its
engines and prompts longer than several compression windows and than the sliding window."""
from __future__ import annotations

from pathlib import Path

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 32}
WINDOW = 16  # tiny_deepseek_v4_config's sliding_window
BLOCK = 16
GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32)


def write_v4(out_dir: Path) -> str:
    return str(write_tiny_deepseek_v4(out_dir, seed=1, layer_types=KINDS, index_n_heads=8, index_topk=4,
                                      compress_rates=RATES))


def v4_engine(ckpt: str, **kw: object) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = {"model": ckpt, "tokenizer": "smollm2", "num_kv_blocks": 48, "block_size": BLOCK,
           "max_num_batched_tokens": 4096, **kw}
    return LLMEngine(EngineConfig(**cfg))


def v4_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random ids; 140 tokens = 35 CSA and 4 HCA windows (plus a pending 12), 8.75 sliding windows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def plane_layout(engine: LLMEngine) -> list[int]:
    """Tensors per layer's cache tuple: 2 for a sliding layer, more for a compressed one."""
    return [len(layer) for layer in engine.kv_caches]
