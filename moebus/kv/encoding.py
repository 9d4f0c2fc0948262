"""Self-describing binary layout for a list of tensors plus a JSON header.

`MAGIC | u16 version | u16 0 | u32 header_len | u32 header CRC-32 | header JSON | pad | blob 0 | pad | blob 1 ...`
Blobs start on 64-byte boundaries (relative to the data start) so views of any dtype stay
aligned. The header lists each blob's dtype, shape and offset; bfloat16 travels as raw bytes.
The header carries its own CRC-32 (a flipped bit there is never decoded into a wrong shape or
token id); checksums of the tensor data are the callers' (KVBlock, KVPayload: per block).
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

MAGIC = b"MBKV"
# 2: the header CRC-32. 3: KV headers list each layer's cache tuple length ("layout": (k, v,
# *planes)). 4: payloads name each tensor's KV group and carry windowed tensors only from
# "window_start" on (bounded sliding windows); a tier block may hold a window part as 0 rows.
# 5: blocks and payloads name their identity (block hash, KV fingerprint), XORed into each block's
# checksum. Another version is refused (KVVersionError); in a disk tier such files read as corrupt
# and are recomputed.
VERSION = 5
ALIGN = 64
_PREFIX = struct.Struct("<4sHHII")


class KVVersionError(ValueError):
    """The encoding is a KV encoding of another format version (sender and receiver differ)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array: no copy for a contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dim() == 0:
        t = t.detach().cpu().contiguous().reshape(-1)
    return t.detach().view(torch.uint8).numpy().reshape(-1)


_NUMPY_DTYPES = {torch.float32, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32, torch.int64}


def crc32_of(tensors: Iterable[torch.Tensor], crc: int = 0) -> int:
    """CRC-32 of the tensors' bytes, in order. zlib's CRC-32 is several times faster than blake2b
    on one core (GIL released), and CRC-32 catches every burst error up to 32 bits."""
    for t in tensors:
        if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.requires_grad:
            crc = zlib.crc32(t.numpy(), crc)  # any C-contiguous buffer: no per-tensor byte view to build
        else:
            crc = zlib.crc32(_as_bytes(t), crc)
    return crc


class PackedTensors:
    """Header + blob layout computed once, so callers can size a buffer before writing."""

    def __init__(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.tensors = [t.detach().cpu().contiguous() for t in tensors]
        specs, off = [], 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            specs.append({"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": n})
            off = _align(off + n)
        self.header = json.dumps({**meta, "tensors": specs}, separators=(",", ":")).encode()
        self.data_start = _align(_PREFIX.size + len(self.header))
        self.specs = specs
        self.nbytes = self.data_start + (specs[-1]["offset"] + specs[-1]["nbytes"] if specs else 0)

    def write_into(self, buf: memoryview | bytearray) -> int:
        """Write the whole encoding into buf[:nbytes] (a bytearray or a shared-memory view)."""
        out = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes)
        out[: self.data_start] = 0
        prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(self.header), zlib.crc32(self.header))
        out[: _PREFIX.size] = np.frombuffer(prefix, np.uint8)
        out[_PREFIX.size: _PREFIX.size + len(self.header)] = np.frombuffer(self.header, np.uint8)
        for t, s in zip(self.tensors, self.specs, strict=True):
            start = self.data_start + s["offset"]
            out[start: start + s["nbytes"]] = _as_bytes(t)
        return self.nbytes

    def to_bytes(self) -> bytearray:
        buf = bytearray(self.nbytes)
        self.write_into(buf)
        return buf


def pack(meta: dict[str, Any], tensors: list[torch.Tensor]) -> bytearray:
    return PackedTensors(meta, tensors).to_bytes()


def unpack(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Decode into freshly allocated tensors (one copy; buf may be read-only or released after).
    ValueError for anything but an intact header with all its blobs present."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREFIX.size:
        raise ValueError("truncated KV encoding")
    magic, version, _, hlen, hcrc = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError(f"not a KV encoding (magic {magic!r})")
    if version != VERSION:
        raise KVVersionError(f"KV encoding format version {version}; this build reads version {VERSION} "
                             "(prefill and decode workers, or a disk tier, from another moebus build)")
    header = bytes(mv[_PREFIX.size: _PREFIX.size + hlen])
    if len(header) != hlen or zlib.crc32(header) != hcrc:
        raise ValueError("KV encoding header is truncated or fails its checksum")
    meta = json.loads(header)
    data_start = _align(_PREFIX.size + hlen)
    src = np.frombuffer(mv, dtype=np.uint8)
    tensors = []
    for s in meta.pop("tensors"):
        start = data_start + s["offset"]
        if start + s["nbytes"] > len(mv):
            raise ValueError("truncated KV encoding")
        t = torch.empty(s["shape"], dtype=getattr(torch, s["dtype"]))
        if s["nbytes"]:
            t.reshape(-1).view(torch.uint8).numpy()[:] = src[start: start + s["nbytes"]]
        tensors.append(t)
    return meta, tensors
