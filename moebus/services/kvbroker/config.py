from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from moebus.shared.service import ServiceConfig

GiB = 1 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """A size with an optional binary unit: "512M", "4GiB", "2k", "1024"."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 4GiB)")
    return int(m.group(1)) * _UNITS[m.group(2)]


class KVBrokerConfig(ServiceConfig):
    cpu_bytes: int = Field(4 * GiB, ge=1)  # the broker's host-memory tier
    disk_dir: str | None = None  # directory of the disk tier; None: no disk tier
    disk_bytes: int = Field(64 * GiB, ge=1)
    disk_fsync: bool = False
    chunk_bytes: int = Field(512 * 1024, ge=1024)  # KV transfer chunk size
    holder_ttl_s: float = Field(30.0, gt=0)  # forget a holder's blocks after it has been silent this long
    expire_interval_s: float = Field(5.0, gt=0)
    # All our tiers hold, published this often (< the balancers' kv_holder_ttl_s): lost events heal.
    snapshot_s: float = Field(10.0, gt=0)

    @field_validator("cpu_bytes", "disk_bytes", "chunk_bytes", mode="before")
    @classmethod
    def _sizes(cls, v: Any) -> Any:
        return parse_bytes(v) if isinstance(v, str) else v
