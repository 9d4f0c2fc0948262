"""The import rules of docs/ARCHITECTURE.md, enforced by import-linter (contracts in pyproject.toml):
shared imports no torch and nothing internal (but kv.hashing, a leaf); kernels only torch/triton;
services never import each other; the engine imports no NATS and no service; moebus.kv imports
no service and never the engine loop (llm_engine: it asks the engine through kv.host.KVHost), its
hashing, index, broker client and credit no torch, and the KV code the engine loads no NATS."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("import-linter is not installed (it is in the dev extras)")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout[-4000:]
