import pytest

from moebus.engine.llm import LLM
from moebus.engine.loader.gguf_cache import converted_dir
from moebus.text.gguf import embedded_gguf_path


@pytest.fixture(scope="session")
def smol_dir():
    """HF-layout copy of the embedded GGUF (config.json + model.safetensors + tokenizer.json)."""
    return converted_dir(embedded_gguf_path())


@pytest.fixture(scope="session")
def llm(smol_dir) -> LLM:
    return LLM(max_num_batched_tokens=512)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a neural network is in one sentence."}],
]


@pytest.fixture(scope="session")
def chat_prompts(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c)) for c in CHATS]
