"""The weight format for `weight_format="auto"` (what `moebus up` and `moebus generate` run): a GGUF's
own quantized blocks, or its weights dequantized to the compute dtype.

The blocks, on a CPU with AVX-512 that runs kernels/qpanel.py, are the more faithful and the
faster choice for a lone stream: they are the file's weights exactly (16-bit activations: KL 1.4e-7
against HF fp32 on the dequantized weights, against bf16's 1.6e-3), every row count takes one
formula (a request's logits the same bits alone or batched), and a decode step reads 4.5-8.5 bits a
weight instead of 16 (BENCHMARKS.md, "A lone stream on the GGUF's blocks": the lone stream well
ahead of bf16, batches of 64 somewhat behind it, the per-block scales costing float work a block).
So auto takes the blocks only where all of that was measured: a Llama GGUF whose weights are
mostly in a block type (a bf16 or f32 file has none to serve), dtype auto (an explicit dtype asks
for dense weights in it), a CPU with AVX-512 and without AMX (whose bf16 tiles were not measured
against the panels). The MoE decoder families serve their blocks only when asked (`weight_format
gguf`): on a Granite-3.0-1B-A400M-shaped Q8_0 file the lone stream is faster than bf16's and ahead
of llama-server on the same file, but prefill and batches run on the integer panels' 16-bit dots,
slower than bf16's, and the float32 KV cache holds half the tokens (BENCHMARKS.md, "An MoE
on its GGUF's blocks"): a latency choice, not a default.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moebus.engine.models import QUANTIZED_ARCHS
from moebus.platforms.cpu.flags import cpu_flags

log = logging.getLogger(__name__)

FORMATS = ("auto", "dense", "gguf")
GGUF_ARCHS = ("LlamaForCausalLM",)  # the families auto serves on their blocks (QUANTIZED_ARCHS: when asked)
QUANTIZED_SHARE = 0.5  # of the file's weights (elements) in Q4_0 / Q4_1 / Q8_0 blocks
PANEL_FLAGS = ("avx512f", "avx512bw")


@dataclass(frozen=True, slots=True)
class FormatChoice:
    weight_format: str  # "dense" or "gguf"
    dtype: str  # the compute dtype to resolve next ("auto" stays auto for dense)
    reason: str


def _gguf_arch(path: Path) -> str:
    """The architecture of the HF checkpoint the GGUF converts to (converted once and cached: the
    load that follows reads the same directory)."""
    import json

    from moebus.engine.loader.gguf_cache import converted_dir

    cfg = json.loads((converted_dir(path) / "config.json").read_text())
    return (cfg.get("architectures") or ["?"])[0]


def _quantized_share(path: Path) -> float:
    """The share of the GGUF's weight elements stored in a type the blocks' kernels take as it is
    (the tensor directory only: the data stays mapped, unread). Not the k-quants: a k-quant file's
    blocks (rewritten at load) were not measured for auto, so they are served when asked for."""
    from gguf import GGUFReader

    from moebus.engine.loader.gguf_file import KERNEL_TYPES

    sizes = [(t.tensor_type.name, int(t.n_elements)) for t in GGUFReader(str(path)).tensors]
    total = sum(n for _, n in sizes)
    return sum(n for name, n in sizes if name in KERNEL_TYPES) / max(total, 1)


def choose_format(path: Path, requested: str, dtype: str, device: str = "cpu",
                  flags: Iterable[str] | None = None, gguf_facts: tuple[str, float] | None = None) -> FormatChoice:
    """Resolve `requested` ("auto", "dense" or "gguf") for the model file at `path`, asked to run in
    `dtype` ("auto" or explicit). flags: the CPU's (default: read them). gguf_facts: the GGUF's HF
    architecture and quantized share where the caller read them from its header (default: read
    here, converting the file: services/worker_memory.py decides before the conversion)."""
    if requested not in FORMATS:
        raise ValueError(f"weight_format must be one of {FORMATS}, not {requested!r}")
    if requested != "auto":  # the blocks' kernels take float32 activations: gguf's dtype auto is float32
        return FormatChoice(requested, "float32" if requested == "gguf" and dtype == "auto" else dtype, "asked for")
    have = set(cpu_flags() if flags is None else flags)
    why_not = (f"device {device}" if not device.startswith("cpu")
               else f"dtype {dtype} asked for" if dtype != "auto"
               else "not a GGUF" if path.suffix != ".gguf"
               else "no AVX-512 for the panels" if not all(f in have for f in PANEL_FLAGS)
               else "an AMX CPU: bf16 tiles" if "amx_bf16" in have
               else None)
    if why_not is None:
        arch, share = gguf_facts or (_gguf_arch(path), _quantized_share(path))
        if share < QUANTIZED_SHARE:
            why_not = f"{share:.0%} of the GGUF's weights in Q4_0/Q4_1/Q8_0 blocks"
        elif arch in QUANTIZED_ARCHS and arch not in GGUF_ARCHS:
            why_not = f"a {arch} GGUF: its blocks are a latency choice (weight_format gguf)"
        elif arch not in GGUF_ARCHS:
            why_not = f"a {arch} GGUF (blocks served for {', '.join(QUANTIZED_ARCHS)})"
    if why_not:
        return FormatChoice("dense", dtype, f"auto: dense weights ({why_not})")
    return FormatChoice("gguf", "float32", "auto: the GGUF's blocks on AVX-512 panels, float32 activations")


def resolve_format(path: Path, requested: str, dtype: str, device: str = "cpu") -> FormatChoice:
    """choose_format, logged once at engine start."""
    choice = choose_format(path, requested, dtype, device)
    if requested == "auto":
        log.info("weight format %s (%s)", choice.weight_format, choice.reason)
    return choice
