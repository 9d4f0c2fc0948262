"""W3C trace context: one request is one trace across NATS hops and services."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import AbortRequest, GenerateAccepted
from moebus.shared.tracing import Tracing, current_trace_id, make_tracer_provider

from .conftest import toy_stack


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    return exp, make_tracer_provider("test", [SimpleSpanProcessor(exp)])


async def test_two_hops_share_one_trace(nats_server, exporter) -> None:
    exp, provider = exporter
    a = await Bus.connect(BusConfig(servers=[nats_server.url], name="a"), Tracing("a", provider))
    b = await Bus.connect(BusConfig(servers=[nats_server.url], name="b"), Tracing("b", provider))
    seen: dict[str, str | None] = {}

    async def hop2(req: AbortRequest, msg) -> GenerateAccepted:
        seen["hop2"] = current_trace_id()
        assert "traceparent" in msg.headers
        return GenerateAccepted(request_id=req.request_id, worker_id="b")

    async def hop1(req: AbortRequest, _msg) -> GenerateAccepted:
        seen["hop1"] = current_trace_id()
        return await a.request("t.trace.hop2", req, GenerateAccepted, timeout=2)  # second hop, from inside hop 1

    await b.subscribe("t.trace.hop1", AbortRequest, hop1)
    await a.subscribe("t.trace.hop2", AbortRequest, hop2)
    await a.flush()
    await b.flush()
    with Tracing("client", provider).span("client request"):
        origin = current_trace_id()
        await a.request("t.trace.hop1", AbortRequest(request_id="r"), GenerateAccepted, timeout=2)
    assert origin is not None and seen == {"hop1": origin, "hop2": origin}
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert spans["t.trace.hop2"].parent.span_id == spans["t.trace.hop1"].context.span_id
    assert spans["t.trace.hop1"].parent.span_id == spans["client request"].context.span_id
    await a.drain()
    await b.drain()


async def test_http_request_is_one_trace_across_services(nats_server, exporter) -> None:
    exp, provider = exporter
    async with toy_stack(nats_server.url, tracer_provider=provider) as stack:
        client = stack.client()
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        await client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    spans = exp.get_finished_spans()
    by_name = {s.name: s for s in spans}
    # HTTP span (frontend) -> render (tokenizer), route (balancer) -> generate (worker)
    for name in ("POST /v1/chat/completions", "render", "route", "generate"):
        assert name in by_name, sorted(by_name)
        assert format(by_name[name].context.trace_id, "032x") == trace_id, name
    assert by_name["generate"].parent.span_id == by_name["route"].context.span_id
