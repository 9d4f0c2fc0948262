"""The balancer's torch-free prompt hashing names blocks exactly as the workers' KV code does."""
from __future__ import annotations

import random

import pytest

from moebus.shared.kv_hashing import stable_block_hashes


def test_shared_hashes_equal_the_engine_ones() -> None:
    engine_hashing = pytest.importorskip("moebus.engine.kv_transfer.hashing")
    rng = random.Random(0)
    for n, bs in ((0, 16), (15, 16), (16, 16), (16 * 9 + 17, 16), (100, 7)):
        ids = [rng.randrange(50_000) for _ in range(n)]
        assert stable_block_hashes(ids, bs, "smollm2|float32|16") == \
            engine_hashing.stable_block_hashes(ids, bs, "smollm2|float32|16")
    ids = list(range(64))
    assert stable_block_hashes(ids, 16, "a") != stable_block_hashes(ids, 16, "b")
