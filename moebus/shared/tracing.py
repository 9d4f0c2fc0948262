"""W3C trace context over NATS headers: one client request = one trace across every service.

Publishers call `inject` (adds ``traceparent``/``tracestate`` for the current span); receivers wrap
their handler in `consume`, which starts a span whose parent is the extracted context.
The tracer comes from an explicit TracerProvider (tests pass their own; a service builds its own
from the environment, shared/trace_export.py), not a module global. `start` / `record` make spans
of a request's later stages (queue, prefill, decode, KV moves) under a context kept from its
handler, with explicit times where the work was timed elsewhere (the engine thread). Attribute
names: `Attr` (OpenTelemetry GenAI semantic conventions where one exists, `moebus.*` otherwise).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACE_ID_HEADER = "X-Trace-Id"  # on every HTTP response: what `moebus trace` takes


class Attr:
    """Span attribute names: GenAI semantic conventions (gen_ai.*) where they exist."""

    OPERATION = "gen_ai.operation.name"
    SYSTEM = "gen_ai.provider.name"
    MODEL = "gen_ai.request.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    CHOICES = "gen_ai.request.choice.count"
    RESPONSE_ID = "gen_ai.response.id"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    TTFT = "gen_ai.server.time_to_first_token"  # seconds (the semconv metric's name)
    REQUEST_ID = "moebus.request_id"  # the HTTP request's (X-Request-Id)
    GENERATION_ID = "moebus.generation_id"  # the bus request's (GenerateRequest.request_id)
    WORKER = "moebus.worker_id"


class Tracing:
    def __init__(self, service: str, provider: trace.TracerProvider | None = None) -> None:
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer(f"moebus.{service}")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, parent: otel_context.Context | None = None, start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span that is not made current (the caller ends it, maybe in another task)."""
        return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns)

    def record(self, name: str, parent: otel_context.Context | None, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> None:
        """A finished span timed elsewhere."""
        self.start(name, parent, start_ns, attributes).end(end_ns)

    def inject(self, headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """Copy of `headers` plus the current span's trace context."""
        carrier = dict(headers or {})
        ctx = trace.get_current_span().get_span_context()
        if ctx.trace_state:  # (we set none; a caller's came with its traceparent)
            self._propagator.inject(carrier)
        elif ctx.is_valid:  # what the propagator writes, without its machinery (every bus message)
            carrier[TRACEPARENT] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        return carrier

    @contextmanager
    def consume(self, name: str, headers: Mapping[str, str] | None,
                kind: SpanKind = SpanKind.CONSUMER) -> Iterator[Span]:
        """Span for handling a received message, child of the sender's span. A bus message sent
        outside any trace (heartbeats, KV events, probes) belongs to no request: no span."""
        carrier = _lowercase(headers)
        if kind is SpanKind.CONSUMER and TRACEPARENT not in carrier:
            yield trace.INVALID_SPAN
            return
        ctx = self.extract(carrier)
        with self._tracer.start_as_current_span(name, context=ctx, kind=kind) as span:
            yield span

    def extract(self, carrier: Mapping[str, str]) -> otel_context.Context:
        """The parent context a lowercase carrier names. A plain version-00 `traceparent` (what
        every service here sends) is read directly: the first code a handler runs after the
        process slept, where the propagator's generic path is costly when run cold (issue 21 target 3).
        Anything else (a `tracestate`, another version, a malformed value) goes to the propagator."""
        tp = carrier.get(TRACEPARENT)
        if "tracestate" not in carrier and isinstance(tp, str) and _plain_traceparent(tp):
            trace_id, span_id = int(tp[3:35], 16), int(tp[36:52], 16)
            if trace_id and span_id:
                parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(tp[53:55], 16)))
                return trace.set_span_in_context(NonRecordingSpan(parent))
        return self._propagator.extract(carrier)

    @contextmanager
    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
        with self._tracer.start_as_current_span(name, kind=kind) as span:
            yield span


def current_context() -> otel_context.Context:
    """The current context: a parent for spans started later, outside this task or call."""
    return otel_context.get_current()


def as_parent(span: Span) -> otel_context.Context:
    return trace.set_span_in_context(span)


def trace_id_of(span: Span) -> str | None:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def make_tracer_provider(service: str, processors: list[SpanProcessor] = ()) -> TracerProvider:
    """An SDK provider (real span ids); exporters are the deployment's business."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"moebus-{service}"}))
    for p in processors:
        provider.add_span_processor(p)
    return provider


_HEX = frozenset("0123456789abcdef")


def _plain_traceparent(tp: str) -> bool:
    """`00-<32 hex>-<16 hex>-<2 hex>`, lowercase, nothing after (W3C trace context, version 00)."""
    return (len(tp) == 55 and tp[:3] == "00-" and tp[35] == "-" and tp[52] == "-"
            and _HEX.issuperset(tp[3:35]) and _HEX.issuperset(tp[36:52]) and _HEX.issuperset(tp[53:]))


def _lowercase(headers: Mapping[str, str] | None) -> dict[str, str]:
    # HTTP frameworks and some NATS clients change header case; W3C names are lowercase.
    return {k.lower(): v for k, v in (headers or {}).items()}


def annotate(attributes: Mapping[str, Any]) -> None:
    """Attributes on the current span (a handler's), when it records; None values are left out."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
