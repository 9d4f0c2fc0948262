"""A request a worker holds, from its acceptance to its last chunk."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moebus.shared.messages import GenerateRequest
from moebus.shared.messages.generate import ResumedChoice

if TYPE_CHECKING:
    from .spans import RequestSpans


@dataclass(slots=True)
class Active:
    req: GenerateRequest
    trace_headers: dict[str, str]  # the generate span's context, for every chunk of the stream
    accepted_at: float
    params: Any  # engine parameters (all n choices: the engine fans out)
    seq: list[int] = field(default_factory=list)  # next chunk sequence number per choice
    open: set[int] = field(default_factory=set)  # choice indices not finished yet
    started: bool = False  # some token went out: no longer safe to hand back for a rerun
    first_token: int | None = None  # stage prefill: the token streamed, handed to the decode worker
    last_chunk_at: float = 0.0  # when its latest chunk went out (inter-token latency)
    spans: RequestSpans | None = None  # its spans here, when traced (spans.py)
    # suspects (quarantine.py): per choice, the tokens streamed from here, to resume it here if its
    # batch breaks the engine and is split
    sent: dict[int, list[int]] = field(default_factory=dict)

    def resumed_here(self) -> GenerateRequest:
        """The request going on from every token it has streamed (from here or before), for a rerun
        on this worker under the same attempt (chunk numbers go on)."""
        before = {c.index: c.token_ids for c in self.req.resume}
        if not before and not any(self.sent.values()):
            return self.req  # nothing streamed yet: it starts over as it came
        resume = [ResumedChoice(index=i, token_ids=[*before.get(i, []), *self.sent.get(i, [])])
                  for i in sorted(self.open)]
        return self.req.model_copy(update={"resume": resume})
