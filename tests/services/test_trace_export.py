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
from moebus.devmodel.toy import TOY_REPLY
from moebus.shared.nats_server import free_port
from moebus.shared.trace_export import JsonlSpanExporter, TraceConfig, build_provider, flush_provider
from moebus.shared.tracing import Tracing, make_tracer_provider

from .conftest import toy_stack, wait_for

MESSAGES = [{"role": "user", "content": "tell me a story"}]
# One event loop runs the whole stack here; on a loaded 2-core box it can stall past three 0.1 s
# beats, and the balancer would call its only worker lost ("no live worker serves 'toy'").
PATIENT = {"missed_heartbeats": 10}


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
    async with toy_stack(nats_server.url, tracer_provider=provider, balancer=PATIENT) as stack:
        traced, headers = await _stream(stack, extra_headers={"X-Request-Id": "req-trace-1"})
    async with toy_stack(nats_server.url, balancer=PATIENT) as stack:  # tracing off (the services' own providers: nothing exported)
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


async def test_a_client_gone_mid_stream_traces_the_abort(nats_server) -> None:
    memory = InMemorySpanExporter()
    provider = make_tracer_provider("stack", [SimpleSpanProcessor(memory)])
    async with toy_stack(nats_server.url, engine={"step_delay_s": 0.03}, tracer_provider=provider) as stack:
        raw = await stack.client().chat.completions.with_raw_response.create(
            model="toy", messages=MESSAGES, max_tokens=200, stream=True)
        trace_id = raw.headers["x-trace-id"]
        stream, got = raw.parse(), 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()  # the client goes away
        await wait_for(lambda: stack.workers[0].counters["aborted"] == 1)
        await wait_for(lambda: any(s.name == "decode" for s in memory.get_finished_spans()))
    spans = [s for s in memory.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    by_name = {s.name: s for s in spans}
    gen = by_name["generate toy"]
    (abort,) = [s for s in spans if s.name == "abort" and s.parent.span_id == gen.context.span_id]  # the frontend's
    worker_abort = [s for s in spans if s.name == "abort" and s is not abort]
    assert [s.parent.span_id for s in worker_abort] == [abort.context.span_id]  # the worker's handler of it
    decode = by_name["decode"]
    assert decode.attributes["moebus.outcome"] == "aborted" and 0 < decode.attributes["gen_ai.usage.output_tokens"] < 200


async def test_a_migration_is_in_the_requests_trace(nats_server) -> None:
    memory = InMemorySpanExporter()
    provider = make_tracer_provider("stack", [SimpleSpanProcessor(memory)])
    async with toy_stack(nats_server.url, workers=2, engine={"step_delay_s": 0.06},  # the reply outlasts the 2 s grace
                         tracer_provider=provider) as stack:
        raw = await stack.client().chat.completions.with_raw_response.create(
            model="toy", messages=MESSAGES, max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": 120})
        trace_id, stream, text = raw.headers["x-trace-id"], raw.parse(), ""
        async for chunk in stream:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            if len(text) > 3 and not any(w.draining for w in stack.workers):
                holder = next(w for w in stack.workers if w._active)
                asyncio.get_running_loop().create_task(holder.shutdown())  # drains: hands the request back
    spans = [s for s in memory.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    gen = next(s for s in spans if s.name == "generate toy")
    (migrate,) = [s for s in spans if s.name == "migrate"]
    assert migrate.parent.span_id == gen.context.span_id
    assert migrate.attributes["moebus.reason"] == "draining" and migrate.attributes["moebus.attempt"] == 1
    route = [s for s in spans if s.name == "route"]
    assert [r.parent.span_id for r in route] == [gen.context.span_id, migrate.context.span_id]
    assert {r.attributes["moebus.worker_id"] for r in route} == {"worker-0", "worker-1"}
    decodes = sorted((s for s in spans if s.name == "decode"), key=lambda s: s.start_time)
    assert [d.attributes["moebus.outcome"] for d in decodes] == ["handed_back", "finished"]
    assert gen.attributes["moebus.migrations"] == 1
    assert text == TOY_REPLY  # nothing lost or repeated across the move
