from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(slots=True)
class KVBrokerConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    prefix: str = "moebus.v1"  # subject prefix (tests isolate themselves with their own)
    cpu_bytes: int = 4 * GiB  # the broker's host-memory tier
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 64 * GiB
    disk_fsync: bool = False
    chunk_bytes: int = 512 * 1024  # KV transfer chunk size
    holder_ttl_s: float = 30.0  # forget a holder's blocks after it has been silent this long
    expire_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.cpu_bytes < 1 or self.disk_bytes < 1 or self.chunk_bytes < 1024:
            raise ValueError("tier sizes must be >= 1 byte and chunk_bytes >= 1024")
        if self.holder_ttl_s <= 0 or self.expire_interval_s <= 0:
            raise ValueError("holder_ttl_s and expire_interval_s must be > 0")
