"""A worker's resident memory, estimated before any worker starts (`moebus up --workers auto`,
fleet_shape.py): the weight elements the model's header declares, times the width the worker holds
each in, times the copies it keeps; plus its KV cache and its runtime.

What a worker holds, by the weight format and dtype its engine resolves from `auto` (the same
choice: platforms/format_choice.py, dtype_choice.py):
- dense weights, in the compute dtype: a linear layer's weight, oneDNN's packed copy and, on
  AVX-512 CPUs without AMX, the panel kernel's (platforms/cpu/packed_linear.py), so three; a tied
  LM head's copies are the embedding's, so every element but the experts' counts three times. The
  routed experts: their weights and ExpertPanels' packed copy (kernels/fused_moe.py), two.
- a GGUF's blocks: each Q4_0 / Q4_1 / Q8_0 element at its block width twice (QuantLinear's blocks
  and its panels; QuantExperts keeps only panels, counted twice all the same), the embedding once
  more in the dtype (its rows are looked up dense), the other tensors dense.
- the KV cache: kv_cache_bytes, zero-filled at start, so resident from the first step.

Reading a header never reads the tensors: a GGUF's tensor directory (walked with struct, where
gguf's GGUFReader would build every metadata array, the vocabulary's among them) and a safetensors
file's JSON header. A model whose header cannot be read (a .bin checkpoint) gets FALLBACK_PER_FILE_BYTE.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Calibrated on peak anonymous memory (RssAnon) of a worker that loaded the model, prefilled 16 x 256
# tokens, decoded at batch 16 and alone, with its 1 GiB KV cache, on a Zen 4 VM (avx512_bf16, no AMX;
# the same figures from `moebus up` workers): SmolLM2-135M's Q4_1 GGUF on its blocks 1.6 GiB (the
# default there), dense float32 2.9, bf16 2.1; the Granite-3.0-1B-A400M-shaped Q8_0 GGUF dense bf16
# 6.8 (the default), float32 12.1, on its blocks 3.3 (loadtest/moe_checkpoint.py's weights). The
# estimate: 1.1-1.45x those (1.55x on the MoE's blocks, whose experts keep one copy). The file-backed
# pages on top (VmHWM 10.5 GiB for that bf16 worker: the converted copy mapped while loading) are page
# cache, shared by the workers reading one file and counted in MemAvailable, so not counted here.
DENSE_COPIES = 3
EXPERT_COPIES = 2
BLOCK_COPIES = 2
WEIGHT_SLACK = 1.1  # the heap's slack and load-time copies grow with the weights
RUNTIME_BYTES = 1 << 30  # torch, Python, activations: 0.35-0.75 GiB beyond the weights measured
# Where no header says the elements: the most a byte of a model file has been measured to cost
# (SmolLM2's Q4_1 file, ~4.5 bits a weight, dense float32 three times).
FALLBACK_PER_FILE_BYTE = 24
WIDTHS = {"float32": 4, "bfloat16": 2, "float16": 2}
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    elements: int
    expert: bool  # a routed expert's weights: a 3-D stack or an `.experts.` tensor
    gguf_type: str = ""  # a GGUF tensor's type (Q8_0, F32, ...)


@dataclass(frozen=True, slots=True)
class Header:
    tensors: tuple[Tensor, ...]
    architecture: str = "?"  # a GGUF's HF architecture as the loader maps it ("?" unknown or not a GGUF)

    def share_in(self, types: Iterable[str]) -> float:
        """The share of the elements stored in `types` (GGUF types)."""
        types = set(types)
        total = sum(t.elements for t in self.tensors)
        return sum(t.elements for t in self.tensors if t.gguf_type in types) / max(total, 1)


@dataclass(frozen=True, slots=True)
class Estimate:
    bytes: int
    how: str  # what it assumed, for the operator: "bfloat16 dense", "float32 on the GGUF's blocks", ...
    moe: bool = False  # the header declares routed experts


def estimate(path: Path, dtype: str, weight_format: str, kv_cache_bytes: int,
             flags: Iterable[str] | None = None) -> Estimate | None:
    """One worker's resident bytes for the model at `path` asked to run in `dtype` and `weight_format`
    (either may be "auto": resolved as the engine will, for this CPU's `flags`); None where neither
    its header nor its files' size is known."""
    header = read_header(path)
    if header is None:
        size = model_file_bytes(path)
        return None if size is None else Estimate(
            size * FALLBACK_PER_FILE_BYTE + kv_cache_bytes + RUNTIME_BYTES, "no header read: from the file size")
    from moebus.engine.loader.gguf_file import KERNEL_TYPES, QUANT_TYPES
    from moebus.platforms.dtype_choice import choose_dtype
    from moebus.platforms.format_choice import choose_format

    fmt = choose_format(path, weight_format, dtype, flags=flags,
                        gguf_facts=(header.architecture, header.share_in(KERNEL_TYPES)))
    dtype = choose_dtype(fmt.dtype, flags=flags).dtype
    blocks = fmt.weight_format == "gguf"
    weights = weight_bytes(header, WIDTHS[dtype], QUANT_TYPES if blocks else ())
    how = f"{dtype} on the GGUF's blocks" if blocks else f"{dtype} dense"
    return Estimate(int(weights * WEIGHT_SLACK) + kv_cache_bytes + RUNTIME_BYTES, how,
                    any(t.expert for t in header.tensors))


def weight_bytes(header: Header, width: int, block_types: Iterable[str] = ()) -> int:
    """The bytes a worker holds for these tensors: dense at `width` bytes an element, those of
    `block_types` (weight_format gguf) on their GGUF blocks."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from moebus.engine.loader.kquants import TRANSCODED

    block_types = set(block_types)
    total = 0
    for t in header.tensors:
        if t.gguf_type in block_types:
            served = TRANSCODED.get(t.gguf_type, t.gguf_type)  # Q4_K held as Q4_1 blocks, Q6_K/Q5_K as Q8_0
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[served]]
            total += t.elements * size // block * BLOCK_COPIES
            total += t.elements * width if t.name == "token_embd.weight" else 0
        else:
            total += t.elements * width * (EXPERT_COPIES if t.expert else DENSE_COPIES)
    return total


def read_header(path: Path) -> Header | None:
    """The tensors a .gguf file or a checkpoint directory's *.safetensors (those the loader reads)
    declare; None for other formats or an unreadable header."""
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_header(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if files:
            return Header(tuple(t for f in files for t in _safetensors_tensors(f)))
    except (OSError, ValueError, KeyError, TypeError, struct.error):  # not the format it says
        return None
    return None


def _expert(name: str, dims: int) -> bool:
    return dims == 3 or ".experts." in name  # not shared experts: dense linear layers


def _safetensors_tensors(path: Path) -> list[Tensor]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:  # the format's own cap
            raise ValueError(f"{path}: a {n}-byte safetensors header")
        header = json.loads(f.read(n))
    return [Tensor(name, math.prod(info["shape"]), _expert(name, len(info["shape"])))
            for name, info in header.items() if name != "__metadata__"]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _gguf_value(m: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    """(value, where the next one starts) of a GGUF metadata value; arrays are skipped (None)."""
    if kind == _STRING:
        (n,) = struct.unpack_from("<Q", m, pos)
        return m[pos + 8:pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if item in _SCALARS:
            return None, pos + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            _, pos = _gguf_value(m, pos, item)
        return None, pos
    fmt = "<" + _SCALARS[kind]
    return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)


def _gguf_header(path: Path) -> Header | None:
    """GGUF v2/v3 (little-endian): the metadata's scalars and the tensor directory, never the data."""
    from gguf.constants import GGMLQuantizationType

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            return None
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = _gguf_value(m, pos, _STRING)
            (kind,) = struct.unpack_from("<I", m, pos)
            meta[key], pos = _gguf_value(m, pos + 4, kind)
        tensors = []
        for _ in range(n_tensors):
            name, pos = _gguf_value(m, pos, _STRING)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            (kind,) = struct.unpack_from("<I", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12  # the type and the data's offset
            tensors.append(Tensor(str(name), math.prod(dims), _expert(str(name), n_dims),
                                  GGMLQuantizationType(kind).name))
    return Header(tuple(tensors), _hf_architecture(meta))


def _hf_architecture(meta: dict[str, object]) -> str:
    """The HF architecture the loader makes of this GGUF (loader/gguf_archs.py), "?" if none."""
    from moebus.engine.loader.gguf_archs import arch_of

    name = str(meta.get("general.architecture"))

    def lookup(key: str, default: object = None) -> object:
        return meta.get(f"{name}.{key}", default)

    try:
        return arch_of(name).hf_architecture(lookup)
    except (ValueError, KeyError, TypeError):
        return "?"


def model_file_bytes(path: Path) -> int | None:
    """The bytes of a model's weight files: a file's size, or a checkpoint directory's weight files."""
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            total = sum(p.stat().st_size for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
            return total or None
    except OSError:
        return None
    return None
