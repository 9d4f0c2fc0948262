"""Prompt block hashes name KV blocks across processes: they must not depend on the process."""
from __future__ import annotations

import json
import random
import subprocess
import sys

from moebus.kv.hashing import stable_block_hashes


def test_hashes_are_the_same_in_another_process() -> None:
    rng = random.Random(0)
    cases = [([rng.randrange(50_000) for _ in range(n)], bs) for n, bs in ((0, 16), (15, 16), (16, 16),
                                                                          (16 * 9 + 17, 16), (100, 7))]
    code = ("import json, sys; from moebus.kv.hashing import stable_block_hashes as h; "
            "print(json.dumps([h(ids, bs, 'smollm2|float32|16') for ids, bs in json.load(sys.stdin)]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    here = [stable_block_hashes(ids, bs, "smollm2|float32|16") for ids, bs in cases]
    assert json.loads(out.stdout) == here
    assert [len(h) for h in here] == [0, 0, 1, 10, 14]


def test_namespace_and_incremental_hashing() -> None:
    ids = list(range(64))
    assert stable_block_hashes(ids, 16, "a") != stable_block_hashes(ids, 16, "b")
    known = stable_block_hashes(ids[:40], 16, "a")
    assert stable_block_hashes(ids, 16, "a", known) == stable_block_hashes(ids, 16, "a")
    assert stable_block_hashes(ids[:32] + [7] * 32, 16, "a")[:2] == stable_block_hashes(ids, 16, "a")[:2]

