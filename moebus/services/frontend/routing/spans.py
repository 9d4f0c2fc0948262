"""The frontend's spans: the HTTP request (SERVER span, its trace id on the response), and one
`generate <model>` span per generation, under which routing, migration and abort happen (what it
records when the generation ends: finish.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from moebus.shared.messages import SamplingOptions
from moebus.shared.tracing import Attr, Tracing

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


@contextmanager
def stage_span(tracing: Tracing, name: str, **attrs: str | int | bool) -> Iterator[Span]:
    """migrate / abort: short spans under the current one (the generation's)."""
    with tracing.span(name) as span:
        if span.is_recording():
            span.set_attributes({f"moebus.{k}": v for k, v in attrs.items() if v is not None})
        yield span
