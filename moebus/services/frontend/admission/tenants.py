"""API keys -> tenants: the keys file (only hashes of keys, each tenant's limits) and the lookup.

The file is JSON (docs/tenants.md)::

    {"tenants": {"acme": {"weight": 2, "rate": 5, "max_tokens_in_flight": 200000}},
     "keys": [{"sha256": "<hex of sha256(key)>", "tenant": "acme", "label": "ci"}]}

Keys are random (`moebus keys add` makes 256-bit ones), so a plain SHA-256 is enough: a slow
password hash only protects guessable secrets, and would cost every request. A lookup hashes the
presented key and compares it with every stored hash in constant time, without stopping at a
match. The flat keys (`api_keys`, the `api_keys_file`: one a line; $MOEBUS_API_KEYS, deprecated:
the environment is readable in /proc) are hashed the same way into the `default` tenant, whose
limits are the file's `default` entry if it has one, else the admission config's.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import FrontendConfig, TenantLimits

DEFAULT = "default"  # the tenant of flat api_keys, and of every request when auth is off
KEY_PREFIX = "mb-"
API_KEYS_ENV = "MOEBUS_API_KEYS"  # comma-separated flat keys; deprecated for api_keys_file
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: TenantLimits


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # hex digest of the key's UTF-8 bytes
    tenant: str
    label: str = ""  # for people (who holds it); never checked


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantLimits] = {}
    keys: list[KeyEntry] = []

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for k in self.keys:
            if k.tenant not in self.tenants and k.tenant != DEFAULT:
                raise ValueError(f"key {k.sha256[:12]}... names tenant {k.tenant!r}, which has no `tenants` entry")
        if len({k.sha256 for k in self.keys}) != len(self.keys):
            raise ValueError("the same key hash appears twice")
        return self

    @classmethod
    def load(cls, path: str | Path) -> KeysFile:
        return cls.model_validate_json(Path(path).read_bytes())

    def save(self, path: str | Path) -> None:
        """Atomically (a reader never sees half a file), owner-only."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.model_dump_json(indent=2, exclude_defaults=True) + "\n")
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_api_keys(path: str | Path) -> list[str]:
    """A flat keys file: one key a line, blank lines skipped."""
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def write_api_keys(path: str | Path, keys: list[str]) -> Path:
    """A new flat keys file, owner-only (0600) from its creation on: no moment where others may read it."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write("".join(f"{k}\n" for k in keys))
    return Path(path)


def env_api_keys() -> list[str]:
    """Flat keys from $MOEBUS_API_KEYS (deprecated: any process of this user can read the environment)."""
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if keys:
        log.warning("API keys from $%s: the environment of a process is readable in /proc/<pid>/environ; "
                    "use a keys file (api_keys_file, `moebus up --api-key-file`)", API_KEYS_ENV)
    return keys


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_key(path: str | Path, tenant: str, limits: TenantLimits | None = None, label: str = "") -> str:
    """A new key for `tenant` in the keys file (created if missing); returns the key, of which
    only the hash is stored. `limits` set the tenant's entry (a new tenant without: defaults)."""
    path = Path(path)
    keys = KeysFile.load(path) if path.exists() else KeysFile()
    if limits is not None or (tenant not in keys.tenants and tenant != DEFAULT):
        keys.tenants[tenant] = limits or TenantLimits()
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    keys.keys.append(KeyEntry(sha256=hash_key(key), tenant=tenant, label=label))
    KeysFile.model_validate(keys.model_dump()).save(path)
    return key


class KeyRing:
    """Bearer key -> Tenant. With no keys configured, auth is off and everyone is `default`."""

    def __init__(self, entries: list[tuple[bytes, Tenant]], default: Tenant, required: bool) -> None:
        self._entries, self.default, self.required = entries, default, required

    @classmethod
    def from_config(cls, cfg: FrontendConfig) -> KeyRing:
        """Auth is on with a keys file of either kind (even one with no keys: nobody gets in) or flat keys."""
        file = KeysFile.load(cfg.keys_file) if cfg.keys_file else KeysFile()
        tenants = {name: Tenant(name, limits) for name, limits in file.tenants.items()}
        default = tenants.setdefault(DEFAULT, Tenant(DEFAULT, cfg.admission.default_tenant))
        entries = [(bytes.fromhex(k.sha256), tenants[k.tenant]) for k in file.keys]
        flat = [*cfg.api_keys, *(read_api_keys(cfg.api_keys_file) if cfg.api_keys_file else []), *env_api_keys()]
        entries += [(hashlib.sha256(k.encode()).digest(), default) for k in flat]
        return cls(entries, default, required=bool(cfg.keys_file or cfg.api_keys_file or flat))

    def tenant(self, key: str) -> Tenant | None:
        """The key's tenant; None: no such key (auth on)."""
        if not self.required:
            return self.default
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, tenant in self._entries:  # every entry, match or not: the time says nothing
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found

    def tenants(self) -> list[Tenant]:
        return list({t.name: t for _, t in self._entries} | {self.default.name: self.default})


def bearer(authorization: str) -> str:
    return authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""


def describe(keys: KeysFile) -> str:
    """`moebus keys list`: tenants, their limits and their keys' hash prefixes."""
    lines = []
    for name, limits in sorted(keys.tenants.items()):
        lines.append(f"{name}: {json.dumps(limits.model_dump(exclude_defaults=True))}")
    for k in keys.keys:
        lines.append(f"  {k.sha256[:12]}  {k.tenant}  {k.label}".rstrip())
    return "\n".join(lines)
