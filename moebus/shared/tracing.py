"""W3C trace context over NATS headers: one client request = one trace across every service.

Publishers call `inject` (adds ``traceparent``/``tracestate`` for the current span); receivers wrap
their handler in `consume`, which starts a span whose parent is the extracted context.
The tracer comes from an explicit TracerProvider (tests pass their own), not a module global.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"


class Tracing:
    def __init__(self, service: str, provider: trace.TracerProvider | None = None) -> None:
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer(f"moebus.{service}")
        self._propagator = TraceContextTextMapPropagator()

    def inject(self, headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """Copy of `headers` plus the current span's trace context."""
        carrier = dict(headers or {})
        self._propagator.inject(carrier)
        return carrier

    @contextmanager
    def consume(self, name: str, headers: Mapping[str, str] | None,
                kind: SpanKind = SpanKind.CONSUMER) -> Iterator[Span]:
        """Span for handling a received message, child of the sender's span."""
        ctx = self._propagator.extract(_lowercase(headers))
        with self._tracer.start_as_current_span(name, context=ctx, kind=kind) as span:
            yield span

    @contextmanager
    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
        with self._tracer.start_as_current_span(name, kind=kind) as span:
            yield span


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def make_tracer_provider(service: str, processors: list[SpanProcessor] = ()) -> TracerProvider:
    """An SDK provider (real span ids); exporters are the deployment's business."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"moebus-{service}"}))
    for p in processors:
        provider.add_span_processor(p)
    return provider


def _lowercase(headers: Mapping[str, str] | None) -> dict[str, str]:
    # HTTP frameworks and some NATS clients change header case; W3C names are lowercase.
    return {k.lower(): v for k, v in (headers or {}).items()}
