"""KVPayload: the KV blocks of one token prefix, as contiguous per-layer tensors, plus what a
receiver needs to adopt them (token ids, stable block hashes, namespace, first sampled token).

A layer's entry is its whole cache tuple (k, v, *planes), every tensor indexed by block first: a
DeepSeek-V4 compressed layer adds compressor planes, some with fewer rows per block than k. The
encodings list each layer's tuple length ("layout"), so a decoder rebuilds the tuples exactly.

Every block carries a CRC-32 of its tensor bytes, taken where the block is made (the engine's
gather) and kept with it through tiers, the broker and transfers; whoever consumes a block checks
it (tier get, decode), so a flipped bit is dropped and recomputed instead of served.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moebus.engine.kv_transfer.codec import PackedTensors, crc32_of, unpack

LayerKV = list[tuple[torch.Tensor, ...]]  # per layer: (k, v, *planes)


class KVChecksumError(ValueError):
    """Block data (or a payload's generator state) does not match the checksum it carries."""


def block_checksum(layers: LayerKV) -> int:
    """CRC-32 of every tensor of every layer, in order (the layout and shapes are the header's,
    which has its own CRC-32)."""
    return crc32_of(t for kv in layers for t in kv)


def _flat(layers: LayerKV) -> list[torch.Tensor]:
    return [t for kv in layers for t in kv]


def _layout(layers: LayerKV) -> list[int]:
    return [len(kv) for kv in layers]


def _unflatten(tensors: list[torch.Tensor], layout: object) -> LayerKV:
    """Tensors back into per-layer tuples; ValueError unless the layout accounts for all of them."""
    if not isinstance(layout, list) or not all(isinstance(n, int) and n >= 2 for n in layout) \
            or sum(layout) != len(tensors):
        raise ValueError(f"KV encoding layout {layout!r} does not fit its {len(tensors)} tensors")
    out, i = [], 0
    for n in layout:
        out.append(tuple(tensors[i: i + n]))
        i += n
    return out


def _nbytes(layers: LayerKV) -> int:
    return sum(t.numel() * t.element_size() for kv in layers for t in kv)


def stack_blocks(blocks: list[KVBlock]) -> LayerKV:
    """Blocks (same layout) as per-layer tuples of [len(blocks), ...] tensors."""
    return [tuple(torch.stack([b.layers[i][j] for b in blocks]) for j in range(len(kv)))
            for i, kv in enumerate(blocks[0].layers)]


@dataclass(slots=True)
class KVBlock:
    """One block: per layer (k [block_size, Hkv, Dk], v [block_size, Hkv, Dv], *planes [rows, dim]).
    checksum: given when the block comes from somewhere that carried one, else computed now."""

    layers: LayerKV
    checksum: int | None = None

    def __post_init__(self) -> None:
        if self.checksum is None:
            self.checksum = block_checksum(self.layers)

    def intact(self) -> bool:
        return block_checksum(self.layers) == self.checksum

    @property
    def nbytes(self) -> int:
        return _nbytes(self.layers)

    def packed(self) -> PackedTensors:
        return PackedTensors({"kind": "block", "crc": self.checksum, "layout": _layout(self.layers)},
                             _flat(self.layers))

    def encode(self) -> bytearray:
        return self.packed().to_bytes()

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> KVBlock:
        """ValueError (KVChecksumError) unless the encoding is whole and the data matches its checksum."""
        meta, ts = unpack(buf)
        if not isinstance(meta.get("crc"), int):
            raise ValueError("KV block encoding without a checksum")
        block = cls(_unflatten(ts, meta.get("layout")), meta["crc"])
        if not block.intact():
            raise KVChecksumError("KV block data fails its checksum")
        return block


@dataclass(slots=True)
class KVPayload:
    """layers: per layer (k, v, *planes), each [num_blocks, ...]. The blocks hold the KV of token
    positions [0, num_tokens); block_hashes are the stable hashes of the full ones."""

    layers: LayerKV
    block_size: int
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)  # empty for a bundle of tier blocks
    block_hashes: list[int] = field(default_factory=list)
    namespace: str = ""
    request_id: str = ""
    first_token: int | None = None  # the prefill worker's sampled token
    generator_state: torch.Tensor | None = None  # seeded sampling continues the same stream
    block_checksums: list[int] = field(default_factory=list)  # per block; computed here when not given
    corrupt_blocks: int = 0  # from_bytes only: blocks that failed their checksum (they and all after are dropped)

    def __post_init__(self) -> None:
        if self.num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"{self.num_tokens} tokens do not fit {self.num_blocks} blocks")
        if self.token_ids and len(self.token_ids) != self.num_tokens:
            raise ValueError("token_ids must cover exactly num_tokens")
        if any(t.shape[0] != self.num_blocks for kv in self.layers for t in kv):
            raise ValueError(f"every cache tensor must hold {self.num_blocks} blocks")
        if not self.block_checksums:
            self.block_checksums = [block_checksum(self._block_layers(i)) for i in range(self.num_blocks)]
        elif len(self.block_checksums) != self.num_blocks:
            raise ValueError(f"{len(self.block_checksums)} checksums for {self.num_blocks} blocks")

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0][0].shape[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.layers)

    def _block_layers(self, i: int) -> LayerKV:
        return [tuple(t[i] for t in kv) for kv in self.layers]

    def block(self, i: int) -> KVBlock:
        return KVBlock(self._block_layers(i), self.block_checksums[i])

    @classmethod
    def from_blocks(cls, blocks: list[KVBlock], block_hashes: list[int], block_size: int,
                    namespace: str = "") -> KVPayload:
        return cls(stack_blocks(blocks), block_size, len(blocks) * block_size, block_hashes=list(block_hashes),
                   namespace=namespace, block_checksums=[b.checksum for b in blocks])

    # --- wire format -----------------------------------------------------------------------
    def packed(self) -> PackedTensors:
        meta = {"kind": "payload", "block_size": self.block_size, "num_tokens": self.num_tokens,
                "token_ids": self.token_ids, "block_hashes": self.block_hashes, "namespace": self.namespace,
                "request_id": self.request_id, "first_token": self.first_token,
                "has_generator": self.generator_state is not None, "block_crcs": self.block_checksums,
                "generator_crc": crc32_of([self.generator_state]) if self.generator_state is not None else None,
                "layout": _layout(self.layers)}
        tensors = _flat(self.layers)
        if self.generator_state is not None:
            tensors.append(self.generator_state)
        return PackedTensors(meta, tensors)

    def to_bytes(self) -> bytearray:
        return self.packed().to_bytes()

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        """The encoding in chunk_size slices (views of one buffer, in order)."""
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        mv = memoryview(self.to_bytes())
        for off in range(0, len(mv), chunk_size):
            yield mv[off: off + chunk_size]

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> KVPayload:
        """Decode and check every block. A block that fails its checksum ends the payload there
        (a prefix ends at its first hole): the receiver recomputes from that block on, and
        corrupt_blocks says how many failed. ValueError for a torn encoding or generator state."""
        meta, ts = unpack(buf)
        if meta.get("kind") != "payload" or not isinstance(meta.get("block_crcs"), list):
            raise ValueError("not a KVPayload encoding")
        gen = ts.pop() if meta["has_generator"] else None
        if gen is not None and crc32_of([gen]) != meta["generator_crc"]:
            raise KVChecksumError("the payload's generator state fails its checksum")
        layers = _unflatten(ts, meta.get("layout"))
        crcs: list[int] = meta["block_crcs"]
        num_blocks = int(layers[0][0].shape[0]) if layers else 0
        if len(crcs) != num_blocks or any(t.shape[0] != num_blocks for kv in layers for t in kv):
            raise ValueError(f"{len(crcs)} checksums for {num_blocks} blocks, or tensors of other block counts")
        bad = [i for i in range(num_blocks) if block_checksum([tuple(t[i] for t in kv) for kv in layers]) != crcs[i]]
        keep, num_tokens, token_ids = num_blocks, meta["num_tokens"], meta["token_ids"]
        if bad:
            keep = bad[0]
            layers = [tuple(t[:keep] for t in kv) for kv in layers]
            num_tokens = min(num_tokens, keep * meta["block_size"])
            token_ids = token_ids[:num_tokens]
        return cls(layers, meta["block_size"], num_tokens, token_ids, meta["block_hashes"][:keep], meta["namespace"],
                   meta["request_id"], meta["first_token"], gen, crcs[:keep], len(bad))

    @classmethod
    def from_chunks(cls, chunks: list[bytes | memoryview]) -> KVPayload:
        return cls.from_bytes(b"".join(chunks))

    def equal(self, other: KVPayload) -> bool:
        """Bitwise equality of the data and metadata (tests, integrity checks)."""
        same_meta = (self.block_size, self.num_tokens, self.token_ids, self.block_hashes, self.namespace,
                     self.request_id, self.first_token) == (
            other.block_size, other.num_tokens, other.token_ids, other.block_hashes, other.namespace,
            other.request_id, other.first_token)
        return same_meta and _layout(self.layers) == _layout(other.layers) and all(
            _bitwise(a, b) for a, b in zip(_flat(self.layers), _flat(other.layers), strict=True))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
