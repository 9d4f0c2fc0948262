"""Engine configuration: one explicit dataclass, validated up front."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moebus import platforms
from moebus.engine.scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2"  # embedded default, a .gguf path, or an HF-layout checkpoint dir
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "float32"  # "auto": chosen from the CPU's flags (the CLI's default)
    # "gguf": a GGUF's Q4_0/Q4_1/Q8_0 (Q4_K as Q4_1, Q6_K/Q5_K as Q8_0) linear layers run on the file's blocks (~5.6x fewer weight
    # bytes per decoded token than float32; on AVX-512 kernels/qpanel.py at every row count);
    # "dense": the weights dequantized to dtype at load; "auto" (the CLI's default): the blocks where
    # they are measured faster for a lone stream and as faithful (platforms/format_choice.py).
    weight_format: str = "dense"
    # weight_format "gguf": the width decode-sized calls (<= QA_MAX_ROWS rows) quantize activations
    # to for integer dot products (16, or 8 as llama.cpp does), or None for float32 activations
    # everywhere. `moebus eval --config gguf16/gguf8` measures what each costs in answers.
    gguf_activation_bits: int | None = 16
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The step budget while several prompts wait to prefill (SchedulerConfig): a burst of 16 x 128
    # prompts prefills as 12 then 4 and the first tokens of most go out after 3/4 of the work. Not
    # smaller: bf16 GEMMs cost more per row below ~1500 rows. It cut burst TTFT at the same tok/s
    # (docs/benchmarks/history-peers.md, "Burst TTFT: a smaller step budget while prompts compete").
    burst_step_tokens: int | None = 1536
    # One owner (an API call: all its prompts and choices) holds at most this share of max_num_seqs
    # while others wait: its extra sequences queue behind theirs (scheduler.py). 1.0: no cap.
    max_owner_share: float = 0.5
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Sliding-window layers (and other parts read within a horizon) keep only the blocks their window
    # still sees, in a pool of their own (kv.groups): O(window) KV per request. On by default;
    # a model without such parts (full attention only) keeps its one pool either way. KV transfer and
    # the KV tiers move both groups' blocks.
    bound_sliding_window: bool = True
    async_scheduling: bool = False  # overlap CPU work of step N with execution of step N+1
    num_speculative_tokens: int = 0  # n-gram (prompt lookup) drafts per step; 0 = off
    # "ngram": prompt lookup; "mtp": the checkpoint's next-n prediction layer drafts (a DeepSeek-V4
    # checkpoint with num_nextn_predict_layers >= 1; engine/mtp_proposer.py)
    speculative_method: str = "ngram"
    deterministic: bool = False  # batch-invariant results: same request, same tokens, any batch
    # Structured outputs (engine/structured_state.py): a grammar compiles in a child process before
    # its request is admitted, refused (a 400 naming its field) past grammar_compile_timeout_s of
    # that child's CPU time (sampling/compile_pool.py); a request whose grammar costs more than
    # grammar_mask_budget_s of CPU a step (its token mask and accepts, averaged over its last
    # grammar_mask_window steps) fails alone, a 400 too.
    grammar_compile_timeout_s: float = 3.0
    grammar_mask_budget_s: float = 0.05
    grammar_mask_window: int = 3
    seed: int = 0
    # On CPU with glibc: fixed malloc thresholds, so a step's activations are reused from the heap
    # instead of page-faulted in again every step (platforms/cpu/malloc.py; process-wide).
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        if self.weight_format in ("auto", "gguf"):  # before dtype: the blocks run float32 activations
            from moebus.engine.models import resolve

            choice = platforms.current(self.device).resolve_format(resolve(self.model), self.weight_format, self.dtype)
            self.weight_format, self.dtype = choice.weight_format, choice.dtype
        if self.dtype == "auto":  # from the CPU's flags (bf16 with AVX512-BF16/AMX), logged: dtype_choice
            self.dtype = platforms.current(self.device).resolve_dtype("auto")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}")
        if self.weight_format not in ("dense", "gguf"):
            raise ValueError("weight_format must be auto, dense or gguf")
        if self.gguf_activation_bits not in (None, 8, 16):
            raise ValueError("gguf_activation_bits must be 8, 16 or null")
        if self.block_size < 1 or self.max_model_len < 1:
            raise ValueError("block_size and max_model_len must be >= 1")
        if self.async_scheduling and self.num_speculative_tokens:
            raise ValueError("async scheduling and speculative decoding cannot be combined yet")
        if self.speculative_method not in ("ngram", "mtp"):
            raise ValueError("speculative_method must be ngram or mtp")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                               self.burst_step_tokens, self.max_owner_share)
