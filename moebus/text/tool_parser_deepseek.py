"""DeepSeek-V4's output to reasoning, content and function calls, by DeepSeek's own stream parser
(`deepseek-recipe`): a ToolStream over the recipe's Chat Completions chunk processor. In thinking
mode the prompt ends inside `<think>`, so the text up to `</think>` is reasoning; calls are the
`<｜DSML｜...>` blocks (V4 and V4.1 spell them differently: the parser is per prompt format).

`thinking_of` is the rule the tokenizer service applies too (recipe.py): thinking unless the
request's chat_template_kwargs turn it off.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moebus.shared.deepseek_v4 import recipe_version

from .tool_parsers import Emitter, Out

# parser name (FrontendConfig.tool_call_parsers) -> the recipe's model version
RECIPE_PARSERS = {"deepseek_v4": "DeepseekV4Pro", "deepseek_v4.1": "DeepseekV41Flash"}


@dataclass(slots=True)
class Reasoning:
    text: str  # the next piece of the turn's reasoning (chat's reasoning_content)


def thinking_of(kwargs: dict) -> bool:
    t = kwargs.get("thinking", kwargs.get("enable_thinking", True))
    return t.get("type") != "disabled" if isinstance(t, dict) else bool(t)


def parser_for(model: str) -> str | None:
    """The parser of a DeepSeek-V4 checkpoint folder that renders through the recipe, else None."""
    version = recipe_version(model)
    return None if version is None else f"deepseek_{version}"


@dataclass
class DeepSeekV4Parser(Emitter):
    """The recipe's own ids for calls are replaced by ours (new_id); parse_calls false (no tools,
    or tool_choice none): DSML blocks stay text."""

    version: str = "deepseek_v4"
    thinking: bool = True
    parse_calls: bool = True
    reasoning: str = ""
    _proc: Any = None
    _index: dict[int, int | None] = field(default_factory=dict)  # the recipe's call index -> ours
    _done: bool = False

    def __post_init__(self) -> None:
        import deepseek_recipe as dr  # native module: loaded by the models that use it

        self._dr = dr
        req = dr.ConversationRequest(dr.Conversation([]), getattr(dr.ModelVersion, RECIPE_PARSERS[self.version]))
        stage = dr.ThinkingInitialStage.ReasoningStart if self.thinking else None
        opts = dr.ParsingOptions(parse_tool_calls=self.parse_calls, thinking_initial_stage=stage)
        self._proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "chatcmpl", "m"), opts)
        self._proc.push(dr.InferenceChunk.ready())

    def feed(self, text: str) -> list[Out]:
        if text and not self._done:
            self._apply(self._proc.push(self._dr.InferenceChunk.text(text, 0)))
        return self.take()

    def finish(self) -> list[Out]:
        if not self._done:
            self._done = True
            self._apply(self._proc.push(self._dr.InferenceChunk.finish(self._dr.InferenceFinishReason.Stop)))
            self._apply(self._proc.finish())
        for call in self.calls:
            call.complete = _is_object(call.arguments)
        return self.take()

    def _apply(self, chunks: list) -> None:
        for chunk in chunks:
            for choice in json.loads(chunk.to_json()).get("choices", []):
                delta = choice.get("delta") or {}
                if r := delta.get("reasoning_content"):
                    self.reasoning += r
                    self._outs.append(Reasoning(r))
                if c := delta.get("content"):
                    self.text(c)
                for tc in delta.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    if tc["index"] not in self._index:
                        self._index[tc["index"]] = self.start(fn.get("name", ""))
                    self.args(self._index[tc["index"]], fn.get("arguments") or "")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
