"""KVPayload: the KV blocks of one token prefix, as contiguous per-layer tensors, plus what a
receiver needs to adopt them (token ids, stable block hashes, namespace, first sampled token)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moebus.engine.kv_transfer.codec import PackedTensors, unpack

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class KVBlock:
    """One block: per layer (k [block_size, Hkv, Dk], v [block_size, Hkv, Dv])."""

    layers: LayerKV

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def packed(self) -> PackedTensors:
        return PackedTensors({"kind": "block"}, [t for kv in self.layers for t in kv])

    def encode(self) -> bytearray:
        return self.packed().to_bytes()

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> KVBlock:
        _, ts = unpack(buf)
        return cls([(ts[i], ts[i + 1]) for i in range(0, len(ts), 2)])


@dataclass(slots=True)
class KVPayload:
    """layers: per layer (k, v) of shape [num_blocks, block_size, Hkv, D]. The blocks hold the
    KV of token positions [0, num_tokens); block_hashes are the stable hashes of the full ones."""

    layers: LayerKV
    block_size: int
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)  # empty for a bundle of tier blocks
    block_hashes: list[int] = field(default_factory=list)
    namespace: str = ""
    request_id: str = ""
    first_token: int | None = None  # the prefill worker's sampled token
    generator_state: torch.Tensor | None = None  # seeded sampling continues the same stream

    def __post_init__(self) -> None:
        if self.num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"{self.num_tokens} tokens do not fit {self.num_blocks} blocks")
        if self.token_ids and len(self.token_ids) != self.num_tokens:
            raise ValueError("token_ids must cover exactly num_tokens")

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0][0].shape[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def block(self, i: int) -> KVBlock:
        return KVBlock([(k[i], v[i]) for k, v in self.layers])

    @classmethod
    def from_blocks(cls, blocks: list[KVBlock], block_hashes: list[int], block_size: int,
                    namespace: str = "") -> KVPayload:
        n_layers = len(blocks[0].layers)
        layers = [(torch.stack([b.layers[i][0] for b in blocks]), torch.stack([b.layers[i][1] for b in blocks]))
                  for i in range(n_layers)]
        return cls(layers, block_size, len(blocks) * block_size, block_hashes=list(block_hashes),
                   namespace=namespace)

    # --- wire format -----------------------------------------------------------------------
    def packed(self) -> PackedTensors:
        meta = {"kind": "payload", "block_size": self.block_size, "num_tokens": self.num_tokens,
                "token_ids": self.token_ids, "block_hashes": self.block_hashes, "namespace": self.namespace,
                "request_id": self.request_id, "first_token": self.first_token,
                "has_generator": self.generator_state is not None}
        tensors = [t for kv in self.layers for t in kv]
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
        meta, ts = unpack(buf)
        if meta.get("kind") != "payload":
            raise ValueError("not a KVPayload encoding")
        gen = ts.pop() if meta["has_generator"] else None
        return cls([(ts[i], ts[i + 1]) for i in range(0, len(ts), 2)], meta["block_size"], meta["num_tokens"],
                   meta["token_ids"], meta["block_hashes"], meta["namespace"], meta["request_id"],
                   meta["first_token"], gen)

    @classmethod
    def from_chunks(cls, chunks: list[bytes | memoryview]) -> KVPayload:
        return cls.from_bytes(b"".join(chunks))

    def equal(self, other: KVPayload) -> bool:
        """Bitwise equality of the data and metadata (tests, integrity checks)."""
        same_meta = (self.block_size, self.num_tokens, self.token_ids, self.block_hashes, self.namespace,
                     self.request_id, self.first_token) == (
            other.block_size, other.num_tokens, other.token_ids, other.block_hashes, other.namespace,
            other.request_id, other.first_token)
        return same_meta and len(self.layers) == len(other.layers) and all(
            _bitwise(a, b) for x, y in zip(self.layers, other.layers, strict=True) for a, b in zip(x, y, strict=True))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
