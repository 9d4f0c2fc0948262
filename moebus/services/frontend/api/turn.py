"""One assistant turn (n = 1) for the APIs that are not chat completions (Responses, Anthropic
Messages): render the conversation, generate, and read the text back through the turn's
ToolStream, one list of outs per step. Each API turns the outs into its own body, or into its
events through its writer for the one SSE loop (streams/pump.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.shared.messages import SamplingOptions
from moebus.text.tool_parsers import Out, ToolStream, new_call_id

from ..choices.choice import ChoiceState
from ..errors import APIError
from ..keys import FRONTEND, TENANT
from ..routing.generation import Generation
from ..schema.tools import ToolPlan, finish_reason
from ..streams.events import Delta, Event, events
from .rendering import ChatPrompt, render_chat


@dataclass
class Turn:
    gen: Generation
    choice: ChoiceState
    tools: ToolStream
    prompt_tokens: int
    _events: AsyncIterator[Event]

    @property
    def request_id(self) -> str:
        return self.gen.request_id[4:]

    @property
    def finish_reason(self) -> str | None:
        """stop, length or tool_calls (None while it runs)."""
        return finish_reason(self.choice.finish_reason, self.tools)

    async def steps(self) -> AsyncIterator[list[Out]]:
        """The outs of each step (empty lists skipped); ServiceError -> APIError."""
        try:
            async for ev in self._events:
                outs = self.tools.feed(ev.text) if isinstance(ev, Delta) else self.tools.finish()
                if outs:
                    yield outs
        except ServiceError as e:
            raise APIError.from_service_error(e) from None


@asynccontextmanager
async def open_turn(request: web.Request, model: str, prompt: ChatPrompt, params: SamplingOptions, plan: ToolPlan,
                    new_id: Callable[[], str] = new_call_id, param: str = "messages") -> AsyncIterator[Turn]:
    fe = request.app[FRONTEND]
    ids, images = await render_chat(fe, model, prompt, params.max_tokens, param)
    async with fe.generation(model, ids, params, images, request.get(TENANT)) as gen:
        (choice,) = fe.choices(0, params, ids, model)
        turn = Turn(gen, choice, plan.stream(new_id, prompt.template_kwargs), len(ids), events([(gen, [choice])]))
        yield turn
        fe.m_tokens.inc(choice.num_tokens)

