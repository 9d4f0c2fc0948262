"""The tokenizer service renders every chat request through the engine tokenizer's chat template:
compiled once (compiling a real template is a visible share of the TTFT), recompiled when replaced."""
from __future__ import annotations

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from moebus.text.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def test_chat_template_compiled_once_and_again_when_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    real = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string

    def from_string(self, source, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        compiled.append(source)
        return real(self, source, *a, **kw)

    monkeypatch.setattr(jinja2.sandbox.ImmutableSandboxedEnvironment, "from_string", from_string)
    tok = Tokenizer(backend=HFTokenizer(models.BPE()), eos_token_ids=[0], chat_template=TEMPLATE)
    msgs = [{"role": "user", "content": "hi <b>"}]
    assert tok.apply_chat_template(msgs) == '<user>"hi <b>"<a>'  # HF's tojson: no HTML escaping
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == '<user>"hi <b>"'
    assert compiled == [TEMPLATE]
    tok.chat_template = "{{ messages | length }}"
    assert tok.apply_chat_template(msgs) == "1"
    assert compiled == [TEMPLATE, "{{ messages | length }}"]
    tok.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(jinja2.TemplateError, match="no"):
        tok.apply_chat_template(msgs)
