"""The tokenizer a serving process renders prompts with, by model name: the toy's or a real model's
(moebus.text.tokenizer), both torch-free. The tokenizer service loads one, and so does a frontend
that renders prompts itself (FrontendConfig.local_render)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moebus.devmodel.toy import TOY_MODEL, ToyTokenizer


def load_serving_tokenizer(model: str, chat_template_file: str | None = None) -> Any:
    """`chat_template_file`: a jinja file whose template replaces the model's."""
    template = Path(chat_template_file).read_text() if chat_template_file else None
    if model == TOY_MODEL:
        return ToyTokenizer(chat_template=template)
    from moebus.text.tokenizer import load_tokenizer  # tokenizers, jinja2: not for the toy

    return load_tokenizer(model, template)
