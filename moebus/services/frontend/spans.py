"""The frontend's spans: the HTTP request (SERVER span, its trace id on the response), and one
`generate <model>` span per generation, under which routing, migration and abort happen.

Detokenization through the tokenizer service is one bus call per chunk; a span per call would be
a span per token, so each choice gets one `detokenize` span instead (first call to last, with the
calls and the time spent waiting for them), recorded when the generation ends.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from moebus.shared.messages import SamplingOptions
from moebus.shared.tracing import Attr, Tracing, as_parent

if TYPE_CHECKING:
    from .choice import ChoiceState
    from .generation import Generation
    from .latency import Clock

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


@contextmanager
def http_span(tracing: Tracing, request: web.Request, request_id: str | None) -> Iterator[Span]:
    """SERVER span of one HTTP request, continuing the client's `traceparent` if it sent one."""
    with tracing.consume(f"{request.method} {request.path}", dict(request.headers), kind=SpanKind.SERVER) as span:
        if span.is_recording():
            span.set_attributes({"http.request.method": request.method, "url.path": request.path,
                                 **({Attr.REQUEST_ID: request_id} if request_id else {}),
                                 **({Attr.OPERATION: OPERATIONS[request.path]} if request.path in OPERATIONS else {})})
        yield span


def http_status(span: Span, status: int) -> None:
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
        if status >= 500 and status != 499:
            span.set_status(Status(StatusCode.ERROR))


@contextmanager
def generation_span(tracing: Tracing, model: str, prompt_tokens: int, params: SamplingOptions) -> Iterator[Span]:
    """Current while the generation is routed, streamed and closed; `finish_generation` fills it in."""
    attrs = {Attr.MODEL: model, Attr.INPUT_TOKENS: prompt_tokens, Attr.CHOICES: params.n,
             Attr.TEMPERATURE: params.temperature, Attr.TOP_P: params.top_p, Attr.SYSTEM: "moebus"}
    if params.max_tokens is not None:
        attrs[Attr.MAX_TOKENS] = params.max_tokens
    with tracing.span(f"generate {model}") as span:
        if span.is_recording():
            span.set_attributes(attrs)
        yield span


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


@contextmanager
def stage_span(tracing: Tracing, name: str, **attrs: str | int | bool) -> Iterator[Span]:
    """migrate / abort: short spans under the current one (the generation's)."""
    with tracing.span(name) as span:
        if span.is_recording():
            span.set_attributes({f"moebus.{k}": v for k, v in attrs.items() if v is not None})
        yield span
