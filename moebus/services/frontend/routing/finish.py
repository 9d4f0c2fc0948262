"""What a generation's span records when it ends: the worker(s), migrations, output tokens, time to
first token, finish reasons, and a `detokenize` span per choice.

Detokenization through the tokenizer service is one bus call per chunk; a span per call would be
a span per token, so each choice gets one `detokenize` span instead (first call to last, with the
calls and the time spent waiting for them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from moebus.shared.tracing import Attr, Tracing, as_parent

if TYPE_CHECKING:
    from ..choices.choice import ChoiceState
    from ..choices.latency import Clock
    from .generation import Generation


def finish_generation(tracing: Tracing, span: Span, gen: Generation | None, clock: Clock | None) -> None:
    if not span.is_recording():
        return
    if gen is not None:
        span.set_attributes({Attr.GENERATION_ID: gen.request_id, "moebus.migrations": gen.migrations,
                             **({Attr.WORKER: gen.worker_id} if gen.worker_id else {}),
                             **({"moebus.decode_worker_id": gen.decode_worker_id} if gen.decode_worker_id else {})})
    if clock is None:
        return
    span.set_attribute(Attr.OUTPUT_TOKENS, clock.n_tokens)
    if clock.first_at is not None:
        span.set_attribute(Attr.TTFT, round(clock.first_at - clock.started, 6))
    reasons = [c.finish_reason for c in clock.choices if c.finish_reason]
    if reasons:
        span.set_attribute(Attr.FINISH_REASONS, reasons)
    parent = as_parent(span)
    for choice in clock.choices:
        _detokenize_span(tracing, parent, choice)


def _detokenize_span(tracing: Tracing, parent, choice: ChoiceState) -> None:
    d = choice.detok
    if not d.calls:
        return  # the worker's engine detokenized
    tracing.record("detokenize", parent, d.first_ns, d.last_ns,
                   {"moebus.choice": choice.index, "moebus.detokenize.calls": d.calls,
                    "moebus.detokenize.wait_s": round(d.busy_ns / 1e9, 6), Attr.OUTPUT_TOKENS: choice.num_tokens})
