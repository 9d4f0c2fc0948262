"""Spans exported: one streamed chat request through the toy stack (real nats-server, real HTTP,
the openai SDK) is one trace whose spans cover every service with their parents intact; tracing
does not change the output; the JSONL file renders with `moebus trace`; sampling and OTLP export."""
from __future__ import annotations

import asyncio
import io
from contextlib import redirect_stdout

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moebus.cli import main as cli_main
from moebus.shared.nats_server import free_port
from moebus.shared.trace_export import JsonlSpanExporter, TraceConfig, build_provider, flush_provider
from moebus.shared.tracing import Tracing, make_tracer_provider

from .conftest import toy_stack

MESSAGES = [{"role": "user", "content": "tell me a story"}]


async def _stream(stack, **kw) -> tuple[str, dict[str, str]]:
    """The streamed text and the response headers."""
    client = stack.client()
    raw = await client.chat.completions.with_raw_response.create(
        model="toy", messages=MESSAGES, max_tokens=12, temperature=0, stream=True, **kw)
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    return text, dict(raw.headers)


async def test_streamed_chat_is_one_trace_over_every_service(nats_server, tmp_path) -> None:
    memory, path = InMemorySpanExporter(), str(tmp_path / "spans.jsonl")
    provider = make_tracer_provider("stack", [SimpleSpanProcessor(memory), SimpleSpanProcessor(JsonlSpanExporter(path))])
    async with toy_stack(nats_server.url, tracer_provider=provider) as stack:
        traced, headers = await _stream(stack, extra_headers={"X-Request-Id": "req-trace-1"})
    async with toy_stack(nats_server.url) as stack:  # tracing off (the services' own providers: nothing exported)
        plain, plain_headers = await _stream(stack)
    assert traced == plain and traced  # tracing does not change the output
    assert len(plain_headers["x-trace-id"]) == 32  # trace ids exist with tracing off too

    trace_id = headers["x-trace-id"]
    every = memory.get_finished_spans()
    spans = [s for s in every if format(s.context.trace_id, "032x") == trace_id]
    assert len(spans) == len(every)  # background traffic (heartbeats, probes) makes no traces
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["POST /v1/chat/completions"]
    for s in spans:  # every other span hangs under the HTTP request's, through recorded parents
        hop, seen = s, 0
        while hop.parent is not None:
            hop, seen = by_id[hop.parent.span_id], seen + 1
            assert seen < 20
        assert hop is roots[0], s.name
    names = {s.name for s in spans}
    for name in ("generate toy", "render", "route", "generate", "queue", "prefill", "decode", "detokenize"):
        assert name in names, sorted(names)

    def one(name: str):
        (s,) = [s for s in spans if s.name == name]
        return s

    http, gen, route, worker = one("POST /v1/chat/completions"), one("generate toy"), one("route"), one("generate")
    assert http.attributes["moebus.request_id"] == "req-trace-1"
    assert http.attributes["http.response.status_code"] == 200
    assert gen.parent.span_id == http.context.span_id
    assert route.parent.span_id == gen.context.span_id and worker.parent.span_id == route.context.span_id
    assert route.attributes["moebus.worker_id"] == "worker-0" and route.attributes["moebus.route.reason"]
    decode = one("decode")
    assert decode.parent.span_id == worker.context.span_id
    assert one("queue").end_time <= one("prefill").start_time <= one("prefill").end_time <= decode.start_time
    usage_out = gen.attributes["gen_ai.usage.output_tokens"]
    assert usage_out == 12 and decode.attributes["gen_ai.usage.output_tokens"] == 12
    assert gen.attributes["gen_ai.usage.input_tokens"] == one("render").attributes["gen_ai.usage.input_tokens"] > 0
    assert 0 < gen.attributes["gen_ai.server.time_to_first_token"] < (gen.end_time - gen.start_time) / 1e9
    assert gen.attributes["gen_ai.request.model"] == "toy"
    assert len(decode.events) == decode.attributes["moebus.decode.steps"] >= 1  # steps as events, no span per token
    assert sum(e.attributes["tokens"] for e in decode.events) == 12 - 1  # the first token came with prefill
    assert {s.resource.attributes["service.name"] for s in spans} == {"moebus-stack"}  # (one provider here)

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["trace", "req-trace-1", "--file", path]) == 0
    text = out.getvalue()
    print(text)
    assert text.startswith(f"trace {trace_id}: {len(spans)} spans")
    for name in ("POST /v1/chat/completions", "generate toy", "render", "route", "queue", "prefill", "decode"):
        assert f" {name} " in text or text.count(name), name
    lines = text.splitlines()[2:]
    assert len(lines) == len(spans) and lines[0].split()[3] == "POST"
    assert any("worker_id=worker-0" in line and "route" in line for line in lines)
    with redirect_stdout(io.StringIO()):
        assert cli_main(["trace", "0" * 32, "--file", path]) == 1


async def test_sampling_is_parent_based(nats_server) -> None:
    off = build_provider("t", cfg=TraceConfig(file=None))  # nothing exported: ids made, nothing recorded
    with Tracing("t", off).span("x") as span:
        assert span.get_span_context().is_valid and not span.is_recording()
    memory = InMemorySpanExporter()
    never = build_provider("t", cfg=TraceConfig(file="/dev/null", sample=0.0))
    never.add_span_processor(SimpleSpanProcessor(memory))
    t = Tracing("t", never)
    with t.span("new trace"):
        pass
    sampled = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    with t.consume("asked by a sampled caller", sampled):
        pass
    assert [s.name for s in memory.get_finished_spans()] == ["asked by a sampled caller"]
    with pytest.raises(ValueError):
        TraceConfig(sample=1.5)


async def test_otlp_export_reaches_a_collector() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        got.append(msg)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        provider = build_provider("worker", "worker-7", TraceConfig.from_env(env))
        with Tracing("worker", provider).span("prefill"):
            pass
        await flush_provider(provider)
        await asyncio.sleep(0)
    finally:
        await runner.cleanup()
    spans = [(rs.resource, s) for m in got for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for _, s in spans] == ["prefill"]
    attrs = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert attrs["service.name"] == "moebus-worker" and attrs["service.instance.id"] == "worker-7"
