"""Stop strings give the same text on both paths: the engine's detokenizer + StopStringMatcher, and
the frontend's Detok client against the tokenizer service's `detokenize` (used when the engine
gives no text, e.g. the toy engine)."""
from __future__ import annotations

from typing import Any

import pytest

from moebus.devmodel.toy import EOS, TOY_MODEL, ToyTokenizer
from moebus.services.frontend.choices.choice import Detok
from moebus.services.tokenizer.config import TokenizerConfig
from moebus.services.tokenizer.service import TokenizerService
from moebus.shared.subjects import Subjects
from moebus.text.detokenizer import IncrementalDetokenizer
from moebus.text.stop_strings import StopStringMatcher

CASES = [  # text, stops, include_stop, expected text
    ("xabc", ["a", "ab"], True, "xa"),
    ("xabc", ["ab", "a"], False, "x"),
    ("abc", ["abc", "b"], True, "ab"),
    ("Hello world, again", ["world"], False, "Hello "),
    ("Hello\n\nmore", ["\n\n"], True, "Hello\n\n"),
    ("Ünï 日本語!", ["本語", "zz"], False, "Ünï 日"),
    ("Ünï 日本語!", ["語!"], True, "Ünï 日本語!"),
    ("abcEN", ["END"], False, "abcEN"),  # no stop: the held tail comes out at the end
    ("xx STOP1 y", ["STOP1", "STOP"], False, "xx "),
]


class _EngineTokenizer:
    """The toy tokenizer behind the engine's decode(ids, skip_special_tokens) signature."""

    def __init__(self) -> None:
        self.tok = ToyTokenizer()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([i for i in ids if not skip_special_tokens or i != EOS])


def engine_path(prompt: list[int], out: list[list[int]], stops: list[str], include: bool) -> tuple[str, bool]:
    """As LLMEngine post-processes a step: feed the detokenizer's text, flush when the request ends."""
    detok = IncrementalDetokenizer(_EngineTokenizer(), prompt)
    matcher = StopStringMatcher(list(stops), include)
    text = ""
    for i, ids in enumerate(out):
        text += matcher.feed(detok.push(ids))
        if matcher.stopped or i == len(out) - 1:
            return text + matcher.flush(), matcher.stopped
    return text, False


class _InProcessBus:
    """Hands the frontend's detokenize requests straight to a TokenizerService handler."""

    def __init__(self, svc: TokenizerService) -> None:
        self.svc = svc

    async def request(self, subject: str, req: Any, reply_type: type, timeout: float, **_: Any) -> Any:
        return await self.svc.detokenize(req, None)


async def service_path(prompt: list[int], out: list[list[int]], stops: list[str], include: bool) -> tuple[str, bool]:
    svc = TokenizerService(TokenizerConfig(model=TOY_MODEL), tokenizer=ToyTokenizer())
    svc._skip = frozenset(ToyTokenizer.all_special_ids)  # what setup() sets
    detok = Detok(_InProcessBus(svc), Subjects(), TOY_MODEL, 1.0, list(stops), include, context=prompt)
    text = ""
    for i, ids in enumerate(out):
        delta, stopped = await detok.push(ids, finished=i == len(out) - 1)
        text += delta
        if stopped:
            return text, True
    return text, False


def chunked(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


@pytest.mark.parametrize(("text", "stops", "include", "want"), CASES)
@pytest.mark.parametrize("tokens_per_step", [1, 2, 3, 100])
async def test_engine_and_tokenizer_service_agree(text: str, stops: list[str], include: bool, want: str,
                                                  tokens_per_step: int) -> None:
    tok = ToyTokenizer()
    prompt = tok.encode("<|user|>\nhi\n<|assistant|>\n")
    out = chunked(tok.encode(text) + [EOS], tokens_per_step)
    engine = engine_path(prompt, out, stops, include)
    service = await service_path(prompt, out, stops, include)
    assert engine == service
    assert engine[0] == want
