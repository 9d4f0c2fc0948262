"""The spans of one request on a worker, all under its `generate` handler's span (the trace of
the HTTP request that caused it):

- `queue`: accepted -> the engine step that produced its first token began;
- `prefill`: that step (prompt and cached tokens, how many requests the step served);
- `decode`: first token -> last chunk, one `step` event per engine step that gave it tokens (up to
  MAX_STEP_EVENTS; the count of the rest is an attribute), never a span per token;
- split requests: `kv.extract` and `kv.send` (prefill half), `kv.handoff_wait`, `kv.receive`
  and `kv.inject` (decode half: inject queued -> the first step that served it), with bytes.

Times are wall-clock ns, measured where the work runs (the engine thread times its steps and
extractions) and recorded afterwards. A request whose `generate` span does not record (tracing
off, or not sampled) gets no RequestSpans: nothing is done per token. The engine does not say
when it scheduled a request, so a prompt prefilled in chunks over several steps shows its earlier
chunks inside `queue`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from moebus.shared.messages import GenerateRequest, TokenChunk
from moebus.shared.tracing import Attr, Tracing, current_context

from .engine_loop import Prefilled, StepTiming

if TYPE_CHECKING:
    from .active import Active

MAX_STEP_EVENTS = 128
ERRORS = frozenset({"failed", "handed_back"})  # outcomes that mark the decode span an error


class RequestSpans:
    __slots__ = ("tracing", "parent", "req", "accepted_ns", "decode", "started", "tokens", "steps", "last_step_ns",
                 "inject_ns", "reasons")

    def __init__(self, tracing: Tracing, parent: Any, req: GenerateRequest, accepted_ns: int) -> None:
        self.tracing, self.parent, self.req, self.accepted_ns = tracing, parent, req, accepted_ns
        self.decode: Span | None = None
        self.started = False  # its first chunk came
        self.tokens = self.steps = self.last_step_ns = self.inject_ns = 0
        self.reasons: list[str] = []

    @classmethod
    def begin(cls, tracing: Tracing, req: GenerateRequest, worker_id: str,
              accepted_ns: int | None = None) -> RequestSpans | None:
        """In the `generate` handler: None unless its span records. accepted_ns: when the request
        was queued for the engine (its `queue` span's start; default now)."""
        span = trace.get_current_span()
        if not span.is_recording():
            return None
        span.set_attributes({Attr.WORKER: worker_id, Attr.GENERATION_ID: req.request_id, Attr.MODEL: req.model,
                             "moebus.stage": req.stage, "moebus.attempt": req.attempt})
        return cls(tracing, current_context(), req, accepted_ns or time.time_ns())

    def _attrs(self, **extra: Any) -> dict[str, Any]:
        return {Attr.GENERATION_ID: self.req.request_id, "moebus.stage": self.req.stage,
                "moebus.attempt": self.req.attempt, **{k: v for k, v in extra.items() if v is not None}}

    def record(self, name: str, start_ns: int, end_ns: int | None = None, **attrs: Any) -> None:
        self.tracing.record(name, self.parent, start_ns, end_ns or time.time_ns(), self._attrs(**attrs))

    def chunk(self, chunk: TokenChunk, step: StepTiming | None) -> None:
        """A chunk of this request went out; `step`: the engine step that made it."""
        if step is None:
            now = time.time_ns()
            step = StepTiming(now, now, 0)
        n = len(chunk.token_ids)
        self.tokens += n
        if chunk.finish_reason:
            self.reasons.append(chunk.finish_reason)
        if not self.started:
            self.started = True
            self._first(chunk, step)
        elif self.decode is not None and n and step.ended_ns != self.last_step_ns:  # choices of one step: one event
            self.steps += 1
            if self.steps <= MAX_STEP_EVENTS:
                self.decode.add_event("step", {"tokens": n, "batch": step.outputs}, timestamp=step.ended_ns)
        self.last_step_ns = step.ended_ns

    def _first(self, chunk: TokenChunk, step: StepTiming) -> None:
        if self.req.stage == "decode":  # the first token came from the prefill worker
            self.record("kv.inject", self.inject_ns or self.accepted_ns, step.started_ns)
            decode_from = step.started_ns
        else:
            self.record("queue", self.accepted_ns, step.started_ns)
            self.record("prefill", step.started_ns, step.ended_ns, **{
                Attr.INPUT_TOKENS: chunk.num_prompt_tokens, "moebus.cached_tokens": chunk.num_cached_tokens,
                "moebus.batch": step.outputs, "moebus.resumed": bool(self.req.resume)})
            decode_from = step.ended_ns
        if self.req.stage != "prefill":
            self.decode = self.tracing.start("decode", self.parent, decode_from, self._attrs(**{
                "moebus.worker_ttft_s": round((step.ended_ns - self.accepted_ns) / 1e9, 6)}))

    def extracted(self, p: Prefilled) -> None:
        start, end = p.extract_ns
        if start:
            self.record("kv.extract", start, end, **{"moebus.kv.bytes": nbytes(p.payload),
                                                     "moebus.kv.ok": p.payload is not None})

    def injecting(self) -> None:
        self.inject_ns = time.time_ns()

    def end(self, outcome: str, error: str | None = None) -> None:
        """The request left this worker (finished, handed_off, failed, aborted, handed_back...)."""
        if not self.started:  # it never reached a first token here
            self.record("queue", self.accepted_ns, None, **{"moebus.outcome": outcome, "error.type": error})
        if self.decode is None:
            return
        span, self.decode = self.decode, None
        span.set_attributes({Attr.OUTPUT_TOKENS: self.tokens, "moebus.decode.steps": self.steps,
                             "moebus.decode.step_events_dropped": max(0, self.steps - MAX_STEP_EVENTS),
                             "moebus.outcome": outcome})
        if self.reasons:
            span.set_attribute(Attr.FINISH_REASONS, self.reasons)
        if error is not None or outcome in ERRORS:
            span.set_status(Status(StatusCode.ERROR, error or outcome))
        span.end()


def record(a: Active, name: str, start_ns: int, **attrs: Any) -> None:
    """A split stage of `a` that started at start_ns and ends now (nothing when it is not traced)."""
    if a.spans is not None:
        a.spans.record(name, start_ns, None, **attrs)


def nbytes(payload: Any) -> int:
    return int(getattr(payload, "nbytes", 0) or 0)
