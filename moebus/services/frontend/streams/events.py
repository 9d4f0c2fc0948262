"""Turn the chunk streams of one or more Generations into per-choice events for the handlers."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from moebus.shared.messages import TokenLogprob

from ..choices.choice import ChoiceState
from ..routing.generation import Generation


@dataclass(slots=True)
class Delta:
    choice: ChoiceState
    text: str
    logprobs: list[TokenLogprob]


@dataclass(slots=True)
class Finish:
    choice: ChoiceState


Event = Delta | Finish


async def _one(gen: Generation, choices: list[ChoiceState]) -> AsyncIterator[Event]:
    async for item in gen.chunks():
        c = choices[item.index]
        if c.finished:
            continue
        text = await c.feed(item)
        yield Delta(c, text, item.logprobs or [])
        if c.finished:
            if not item.finished:
                gen.finish_choice(item.index)  # a stop string the worker did not see
            yield Finish(c)


async def events(pairs: Sequence[tuple[Generation, list[ChoiceState]]]) -> AsyncIterator[Event]:
    """Events of every generation, interleaved as they come (completions with several prompts)."""
    if len(pairs) == 1:
        async for ev in _one(*pairs[0]):
            yield ev
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(gen: Generation, choices: list[ChoiceState]) -> None:
        try:
            async for ev in _one(gen, choices):
                await out.put(ev)
        except Exception as e:
            await out.put(e)
        finally:
            await out.put(done)

    tasks = [asyncio.create_task(pump(g, c)) for g, c in pairs]
    try:
        remaining = len(tasks)
        while remaining:
            ev = await out.get()
            if ev is done:
                remaining -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield ev
    finally:
        for t in tasks:
            t.cancel()
