"""`--model tiny-v4`: a tiny random DeepSeek-V4 (moebus.engine.distributed.tiny, seed 0) written
into a temporary directory for the length of one run, with one next-n (MTP) layer so the v4-mtp row
can draft with it; plain serving and HF ignore that layer. Its inputs are synthetic.py's ids."""
from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moebus.eval.configs import TINY_V4
from moebus.eval.run import Settings

SEED = 0
OVERRIDES = {"num_nextn_predict_layers": 1}


def write_checkpoint(out_dir: str | Path) -> Path:
    """HF weights, mtp.safetensors and a word-level tokenizer.json in out_dir."""
    from moebus.engine.distributed.tiny import write_tiny_moe_checkpoint

    return write_tiny_moe_checkpoint(out_dir, seed=SEED, **OVERRIDES)


@contextmanager
def resolved(s: Settings) -> Iterator[Settings]:
    """s itself; for --model tiny-v4, settings whose model is the checkpoint written for this run
    (removed on exit) and whose inputs are synthetic."""
    if s.model != TINY_V4:
        yield s
        return
    with tempfile.TemporaryDirectory(prefix="moebus-eval-tiny-v4-") as tmp:
        yield dataclasses.replace(s, model=str(write_checkpoint(tmp)), synthetic=True)
