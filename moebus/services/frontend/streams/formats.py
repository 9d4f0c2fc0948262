"""OpenAI response pieces: usage, chat logprobs, legacy completions logprobs."""
from __future__ import annotations

from moebus.shared.messages import TokenLogprob

from ..choices.choice import ChoiceState


def usage(prompt_tokens: int, choices: list[ChoiceState], cached: int = 0) -> dict:
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _bytes(token: str) -> list[int]:
    return list(token.encode())


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                         "top_logprobs": [{"token": x.token, "logprob": x.logprob, "bytes": _bytes(x.token)}
                                          for x in t.top]} for t in items]}


def completion_logprobs(items: list[TokenLogprob], text_offset: int = 0) -> dict:
    offsets, pos = [], text_offset
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{x.token: x.logprob for x in t.top} for t in items], "text_offset": offsets}
