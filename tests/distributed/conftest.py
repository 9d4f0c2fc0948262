"""Fixtures for EP / attention-DP tests: a tiny MoE checkpoint shared by the session."""
from __future__ import annotations

from pathlib import Path

import pytest

from moebus.engine.distributed.tiny import write_tiny_moe_checkpoint


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 experts top-2 (2 hash-MoE + 2 top-k layers), 1 shared expert, vocab 512, hidden 64."""
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("ep_moe"), seed=0)
