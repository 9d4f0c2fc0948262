"""Tracing.inject / Tracing.extract: the direct W3C `traceparent` path gives what the OpenTelemetry
propagator gives, and anything it does not handle (tracestate, other versions, malformed values)
goes to the propagator."""
from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from moebus.shared.tracing import Tracing

PROPAGATOR = TraceContextTextMapPropagator()
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _ctx(context) -> trace.SpanContext:
    return trace.get_current_span(context).get_span_context()


@pytest.fixture
def tracing() -> Tracing:
    return Tracing("test", TracerProvider())


def test_inject_writes_what_the_propagator_writes(tracing: Tracing) -> None:
    with tracing.span("parent"):
        expected: dict[str, str] = {}
        PROPAGATOR.inject(expected)
        assert tracing.inject({"x-other": "1"}) == {"x-other": "1", **expected}
        assert tracing.inject()["traceparent"].startswith("00-")


def test_inject_outside_any_span_adds_nothing(tracing: Tracing) -> None:
    assert tracing.inject({"a": "b"}) == {"a": "b"}


def test_a_caller_tracestate_goes_on(tracing: Tracing) -> None:
    ctx = tracing.extract({"traceparent": TP, "tracestate": "vendor=abc"})
    with tracing.span("child") as _, trace.use_span(trace.get_current_span(ctx)):
        assert tracing.inject() == {"traceparent": TP, "tracestate": "vendor=abc"}


@pytest.mark.parametrize("tp", [
    TP,
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",  # not sampled
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",  # sampled + random (level 2)
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # invalid trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # invalid span id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later",  # a later version's extra field
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",  # version 00 with extra: invalid
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # uppercase: invalid
    " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # leading blank
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333g-01",  # not hex
    "garbage",
])
def test_extract_matches_the_propagator(tracing: Tracing, tp: str) -> None:
    for carrier in ({"traceparent": tp}, {"traceparent": tp, "tracestate": "k=v"}):
        got, want = _ctx(tracing.extract(carrier)), _ctx(PROPAGATOR.extract(carrier))
        assert got == want
        assert (got.trace_flags, got.is_remote, got.trace_state) == (want.trace_flags, want.is_remote, want.trace_state)


def test_extract_without_a_traceparent_is_the_empty_context(tracing: Tracing) -> None:
    assert not _ctx(tracing.extract({})).is_valid
