"""KVPayload: the KV blocks of one token prefix, as contiguous per-layer tensors, plus what a
receiver needs to adopt them (token ids, stable block hashes, namespace, first sampled token).

A layer's entry is its whole cache tuple (k, v, *planes), every tensor indexed by block first: a
DeepSeek-V4 compressed layer adds compressor planes, some with fewer rows per block than k. The
encodings list each layer's tuple length ("layout"), so a decoder rebuilds the tuples exactly.

With bounded sliding windows (kv.groups) a windowed part (sliding K/V, compressor rows)
is read only near the end, so a payload carries it only from block `window_start` on (the blocks
the next token's window reads), `groups` naming each tensor's group; a tier block whose window
part had already been freed holds it as a tensor of 0 rows (KVBlock.has_window).

Every block carries a CRC-32 of its tensor bytes, taken where the block is made (the engine's
gather) and kept with it through tiers, the broker and transfers; whoever consumes a block checks
it (tier get, decode), so a flipped bit is dropped and recomputed instead of served.

A block also carries its identity: the stable block hash it was made (or first stored) under and
the KV fingerprint of its engine (kv_fingerprint of the namespace: model, dtype, block size and
every layer's cache shapes). A CRC-32 of the identity is XORed into the checksum (16 bytes, no
extra pass over the tensors), so a block read back under another key, or listed under another hash
in a payload, fails like a flipped bit: a tier get compares the block's hash with the key asked
for, and a payload checks each block against its own block_hashes[i].
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moebus.kv.encoding import PackedTensors, crc32_of, unpack
from moebus.kv.hashing import kv_fingerprint

LayerKV = list[tuple[torch.Tensor, ...]]  # per layer: (k, v, *planes)
Groups = list[tuple[int, ...]]  # per layer, per tensor: 0 full history, 1 windowed (kv.groups)
WINDOWED = 1
_U64 = (1 << 64) - 1
_IDENTITY = struct.Struct("<QQ")  # (block hash, fingerprint) as an identity tag hashes them


class KVChecksumError(ValueError):
    """Block data (or a payload's generator state) does not match the checksum it carries."""


class KVIdentityError(KVChecksumError):
    """An intact block that names another block hash or KV fingerprint than the one asked for."""


def identity_tag(block_hash: int | None, fingerprint: int) -> int:
    """What a block's identity adds (XOR) to its data checksum: 0 for a block with none yet."""
    if block_hash is None and not fingerprint:
        return 0
    return zlib.crc32(_IDENTITY.pack(_U64 if block_hash is None else block_hash & _U64, fingerprint & _U64))


def block_checksum(layers: LayerKV, block_hash: int | None = None, fingerprint: int = 0) -> int:
    """CRC-32 of every tensor of every layer, in order (the layout and shapes are the header's,
    which has its own CRC-32), XOR the identity's tag. A missing window part (0 rows) adds no
    bytes: a block without its window part has the checksum of the parts it holds."""
    return crc32_of(t for kv in layers for t in kv) ^ identity_tag(block_hash, fingerprint)


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
    """Blocks (same layout, all parts present) as per-layer tuples of [len(blocks), ...] tensors."""
    return [tuple(torch.stack([b.layers[i][j] for b in blocks]) for j in range(len(kv)))
            for i, kv in enumerate(blocks[0].layers)]


def missing_part(t: torch.Tensor) -> torch.Tensor:
    """The stand-in for a window part a block does not hold: its per-block shape with 0 rows."""
    return t.new_empty((0, *t.shape[1:]))


def block_size_of(blocks: list[KVBlock]) -> int:
    """Tokens a block holds: the rows of a k part (a block may lack its windowed ones; 0 if all do)."""
    return max((int(kv[0].shape[0]) for b in blocks for kv in b.layers), default=0)


def _window_groups(blocks: list[KVBlock]) -> Groups | None:
    """Parts some block lacks (0 rows) are windowed; None when every block holds every part."""
    groups = [tuple(int(any(b.layers[i][j].shape[0] == 0 for b in blocks)) for j in range(len(kv)))
              for i, kv in enumerate(blocks[0].layers)]
    return groups if any(any(g) for g in groups) else None


@dataclass(slots=True)
class KVBlock:
    """One block: per layer (k [block_size, Hkv, Dk], v [block_size, Hkv, Dv], *planes [rows, dim]).
    checksum: given when the block comes from somewhere that carried one, else computed now.
    block_hash, fingerprint: its identity (None / 0 until it is made or first stored under one)."""

    layers: LayerKV
    checksum: int | None = None
    block_hash: int | None = None
    fingerprint: int = 0

    def __post_init__(self) -> None:
        if self.checksum is None:
            self.checksum = block_checksum(self.layers, self.block_hash, self.fingerprint)

    def intact(self) -> bool:
        return block_checksum(self.layers, self.block_hash, self.fingerprint) == self.checksum

    def keyed(self, block_hash: int | None, fingerprint: int = 0) -> KVBlock:
        """The block with the parts of its identity it lacks filled in (those it has are kept, so
        a block of another key stays one and fails check_identity); the checksum follows in O(1)."""
        h = self.block_hash if self.block_hash is not None else block_hash
        fp = self.fingerprint or fingerprint
        if (h, fp) == (self.block_hash, self.fingerprint):
            return self
        tag = identity_tag(self.block_hash, self.fingerprint) ^ identity_tag(h, fp)
        return KVBlock(self.layers, self.checksum ^ tag, h, fp)

    def check_identity(self, block_hash: int, fingerprint: int = 0) -> None:
        """KVIdentityError unless the block is the one stored under block_hash (and, when both
        are known, made for the engine of `fingerprint`)."""
        if self.block_hash != block_hash:
            name = "no hash" if self.block_hash is None else f"hash {self.block_hash:016x}"
            raise KVIdentityError(f"a KV block of {name} was stored under {block_hash:016x}")
        if fingerprint and self.fingerprint and self.fingerprint != fingerprint:
            raise KVIdentityError(f"KV block {block_hash:016x} is of another model or cache layout")

    def has_window(self, groups: Groups) -> bool:
        """Whether the block holds its windowed parts (a tier block may hold only the full ones)."""
        return all(t.shape[0] > 0 for kv, gs in zip(self.layers, groups, strict=True)
                   for t, g in zip(kv, gs, strict=True) if g == WINDOWED)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.layers)

    def packed(self) -> PackedTensors:
        return PackedTensors({"kind": "block", "crc": self.checksum, "layout": _layout(self.layers),
                              "hash": self.block_hash, "fp": self.fingerprint}, _flat(self.layers))

    def encode(self) -> bytearray:
        return self.packed().to_bytes()

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> KVBlock:
        """ValueError (KVChecksumError) unless the encoding is whole and the data matches its checksum."""
        meta, ts = unpack(buf)
        if not isinstance(meta.get("crc"), int) or not isinstance(meta.get("fp"), int) \
                or not isinstance(meta.get("hash"), int | None):
            raise ValueError("KV block encoding without a checksum or identity")
        block = cls(_unflatten(ts, meta.get("layout")), meta["crc"], meta["hash"], meta["fp"])
        if not block.intact():
            raise KVChecksumError("KV block data fails its checksum")
        return block


@dataclass(slots=True)
class KVPayload:
    """layers: per layer (k, v, *planes), each [num_blocks, ...] (a windowed one, per `groups`:
    [num_blocks - window_start, ...], blocks window_start on). The blocks hold the KV of token
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
    groups: Groups | None = None  # None: every tensor holds every block
    window_start: int = 0  # the first block the windowed tensors hold
    fingerprint: int = 0  # kv_fingerprint of the blocks' engine; from `namespace` when not given

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = kv_fingerprint(self.namespace)
        if self.groups is not None and [len(g) for g in self.groups] != _layout(self.layers):
            raise ValueError("groups must name the group of every cache tensor")
        if self.num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"{self.num_tokens} tokens do not fit {self.num_blocks} blocks")
        if self.token_ids and len(self.token_ids) != self.num_tokens:
            raise ValueError("token_ids must cover exactly num_tokens")
        if not 0 <= self.window_start <= self.num_blocks or (self.window_start and self.groups is None):
            raise ValueError(f"window_start {self.window_start} of {self.num_blocks} blocks (groups {self.groups})")
        if any(t.shape[0] != self.num_blocks - self._start(i, j) for i, kv in enumerate(self.layers)
               for j, t in enumerate(kv)):
            raise ValueError(f"every cache tensor must hold {self.num_blocks} blocks (windowed ones from "
                             f"block {self.window_start})")
        if not self.block_checksums:
            self.block_checksums = [block_checksum(self._block_layers(i), *self._identity(i))
                                    for i in range(self.num_blocks)]
        elif len(self.block_checksums) != self.num_blocks:
            raise ValueError(f"{len(self.block_checksums)} checksums for {self.num_blocks} blocks")

    def _start(self, layer: int, part: int) -> int:
        """The first block tensor `part` of `layer` holds."""
        return self.window_start if self.groups is not None and self.groups[layer][part] == WINDOWED else 0

    def _identity(self, i: int) -> tuple[int | None, int]:
        """Block i's (hash, fingerprint): a partial last block has no hash."""
        return (self.block_hashes[i] if i < len(self.block_hashes) else None), self.fingerprint

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0][0].shape[0]) + self._start(0, 0) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.layers)

    def _block_layers(self, i: int) -> LayerKV:
        """Block i's tensors; a windowed one before window_start as 0 rows (missing_part)."""
        if not self.window_start:
            return [tuple(t[i] for t in kv) for kv in self.layers]
        return [tuple(t[i - self._start(li, j)] if i >= self._start(li, j) else t.new_empty((0, *t.shape[2:]))
                      for j, t in enumerate(kv)) for li, kv in enumerate(self.layers)]

    def block(self, i: int) -> KVBlock:
        return KVBlock(self._block_layers(i), self.block_checksums[i], *self._identity(i))

    @classmethod
    def from_blocks(cls, blocks: list[KVBlock], block_hashes: list[int], block_size: int,
                    namespace: str = "") -> KVPayload:
        """Tier blocks as one payload: the windowed parts from the first block after the last one
        that lacks them (blocks before hold only their full parts). Each keeps the checksum of its
        own identity, so a block that is not the one block_hashes[i] names fails its check."""
        fp = kv_fingerprint(namespace) or next((b.fingerprint for b in blocks if b.fingerprint), 0)
        crcs = [b.keyed(block_hashes[i] if i < len(block_hashes) else None, fp).checksum
                for i, b in enumerate(blocks)]
        groups = _window_groups(blocks)
        if groups is None:
            return cls(stack_blocks(blocks), block_size, len(blocks) * block_size, block_hashes=list(block_hashes),
                       namespace=namespace, block_checksums=crcs, fingerprint=fp)
        ws = 1 + max(i for i, b in enumerate(blocks) if not b.has_window(groups))
        layers = [tuple(torch.stack([b.layers[li][j] for b in (blocks[ws:] if g == WINDOWED else blocks)])
                        if g != WINDOWED or ws < len(blocks) else missing_part(kv[j]).unsqueeze(0)[:0]
                        for j, g in enumerate(gs)) for li, (kv, gs) in enumerate(zip(blocks[0].layers, groups,
                                                                                     strict=True))]
        return cls(layers, block_size, len(blocks) * block_size, block_hashes=list(block_hashes), namespace=namespace,
                   block_checksums=crcs, groups=groups, window_start=ws, fingerprint=fp)

    # --- wire format -----------------------------------------------------------------------
    def packed(self) -> PackedTensors:
        meta = {"kind": "payload", "block_size": self.block_size, "num_tokens": self.num_tokens,
                "token_ids": self.token_ids, "block_hashes": self.block_hashes, "namespace": self.namespace,
                "request_id": self.request_id, "first_token": self.first_token,
                "has_generator": self.generator_state is not None, "block_crcs": self.block_checksums,
                "generator_crc": crc32_of([self.generator_state]) if self.generator_state is not None else None,
                "layout": _layout(self.layers), "groups": self.groups, "window_start": self.window_start,
                "fingerprint": self.fingerprint}
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
        """Decode and check every block. A block that fails its checksum (its data, or it is not
        the block its hash names) ends the payload there (a prefix ends at its first hole): the
        receiver recomputes from that block on, and corrupt_blocks says how many failed.
        ValueError for a torn encoding or generator state."""
        meta, ts = unpack(buf)
        if meta.get("kind") != "payload" or not isinstance(meta.get("block_crcs"), list) \
                or not isinstance(meta.get("fingerprint"), int):
            raise ValueError("not a KVPayload encoding")
        gen = ts.pop() if meta["has_generator"] else None
        if gen is not None and crc32_of([gen]) != meta["generator_crc"]:
            raise KVChecksumError("the payload's generator state fails its checksum")
        layers = _unflatten(ts, meta.get("layout"))
        groups = [tuple(g) for g in meta["groups"]] if meta.get("groups") is not None else None
        crcs: list[int] = meta["block_crcs"]
        # the block structure is checked here (a whole payload), the checksums below block by block
        shell = cls(layers, meta["block_size"], 0, block_hashes=meta["block_hashes"], block_checksums=[0] * len(crcs),
                    groups=groups, window_start=meta.get("window_start", 0), fingerprint=meta["fingerprint"])
        num_blocks = shell.num_blocks
        bad = [i for i in range(num_blocks) if block_checksum(shell._block_layers(i), *shell._identity(i)) != crcs[i]]
        keep, num_tokens, token_ids = num_blocks, meta["num_tokens"], meta["token_ids"]
        if bad:
            keep = bad[0]
            ws = min(shell.window_start, keep)
            layers = [tuple(t[: keep - shell._start(li, j)] if keep >= shell._start(li, j) else t[:0]
                            for j, t in enumerate(kv)) for li, kv in enumerate(layers)]
            num_tokens = min(num_tokens, keep * meta["block_size"])
            token_ids = token_ids[:num_tokens]
            shell.window_start = ws
        return cls(layers, meta["block_size"], num_tokens, token_ids, meta["block_hashes"][:keep], meta["namespace"],
                   meta["request_id"], meta["first_token"], gen, crcs[:keep], len(bad), groups, shell.window_start,
                   meta["fingerprint"])

    @classmethod
    def from_chunks(cls, chunks: list[bytes | memoryview]) -> KVPayload:
        return cls.from_bytes(b"".join(chunks))

    def equal(self, other: KVPayload) -> bool:
        """Bitwise equality of the data and metadata (tests, integrity checks)."""
        same_meta = (self.block_size, self.num_tokens, self.token_ids, self.block_hashes, self.namespace,
                     self.request_id, self.first_token) == (
            other.block_size, other.num_tokens, other.token_ids, other.block_hashes, other.namespace,
            other.request_id, other.first_token) and (self.groups, self.window_start, self.fingerprint) == (
            other.groups, other.window_start, other.fingerprint)
        return same_meta and _layout(self.layers) == _layout(other.layers) and all(
            _bitwise(a, b) for a, b in zip(_flat(self.layers), _flat(other.layers), strict=True))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
