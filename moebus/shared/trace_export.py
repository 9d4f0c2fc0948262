"""Where a process's spans go: OTLP over HTTP, a JSONL file, both, or nowhere.

`TraceConfig.from_env()` reads what `moebus up --trace-file/--otlp-endpoint/--trace-sample` (or a
deployment) puts in every process's environment:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): an OTLP/HTTP
  collector (protobuf, `opentelemetry-exporter-otlp-proto-http`);
- ``MOEBUS_TRACE_FILE``: append one JSON object per span to this file (every process may share
  it: each batch is one O_APPEND write, so lines never interleave); `moebus trace` reads it;
- ``MOEBUS_TRACE_SAMPLE``: the share of new traces recorded (0..1, default 1); a request that
  arrives with a sampled/unsampled ``traceparent`` keeps its caller's decision (parent-based).

Export runs on the SDK's BatchSpanProcessor thread: a span's end only queues it (a full queue
drops spans, never waits), so the token path never waits on a collector or a disk. With no
exporter the provider samples nothing, but still makes trace ids: every response and log line
can name its trace (`X-Trace-Id`) even with tracing off.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBasedTraceIdRatio, Sampler

TRACE_FILE_ENV = "MOEBUS_TRACE_FILE"
TRACE_SAMPLE_ENV = "MOEBUS_TRACE_SAMPLE"
OTLP_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_TRACES_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


@dataclass(frozen=True, slots=True)
class TraceConfig:
    file: str | None = None
    otlp_endpoint: str | None = None  # base URL (…/v1/traces is added) or the full traces URL
    sample: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError(f"trace sample ratio must be within 0..1, got {self.sample}")

    @property
    def exporting(self) -> bool:
        return bool(self.file or self.otlp_endpoint)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TraceConfig:
        env = os.environ if env is None else env
        otlp = env.get(OTLP_TRACES_ENV) or env.get(OTLP_ENV) or None
        return cls(file=env.get(TRACE_FILE_ENV) or None, otlp_endpoint=otlp,
                   sample=float(env.get(TRACE_SAMPLE_ENV) or 1.0))

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process this configuration."""
        out = {TRACE_SAMPLE_ENV: repr(self.sample)}
        if self.file:
            out[TRACE_FILE_ENV] = os.path.abspath(self.file)
        if self.otlp_endpoint:
            out[OTLP_ENV] = self.otlp_endpoint
        return out

    def sampler(self) -> Sampler:
        return ParentBasedTraceIdRatio(self.sample) if self.exporting else ALWAYS_OFF


def otlp_traces_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class JsonlSpanExporter(SpanExporter):
    """One JSON line per span (span_json), appended to `path` by one write per batch."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join(orjson.dumps(span_json(s)) + b"\n" for s in spans)
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_json(s: ReadableSpan) -> dict[str, Any]:
    ctx, parent = s.context, s.parent
    return {
        "trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": s.name, "kind": s.kind.name, "service": s.resource.attributes.get("service.name"),
        "instance": s.resource.attributes.get("service.instance.id"),
        "start_ns": s.start_time, "end_ns": s.end_time, "status": s.status.status_code.name,
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in s.events],
    }


def build_provider(service: str, instance_id: str | None = None, cfg: TraceConfig | None = None) -> TracerProvider:
    """The provider of one process (or one in-process service): its exporters behind batch processors."""
    cfg = TraceConfig.from_env() if cfg is None else cfg
    attrs = {"service.name": f"moebus-{service}", **({"service.instance.id": instance_id} if instance_id else {})}
    provider = TracerProvider(resource=Resource.create(attrs), sampler=cfg.sampler())
    if cfg.file:
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(cfg.file)))
    if cfg.otlp_endpoint:
        # protobuf and requests are imported only where OTLP is on
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(cfg.otlp_endpoint))))
    return provider


async def flush_provider(provider: TracerProvider, timeout_s: float = 3.0) -> None:
    """Export what is queued (bounded: a dead collector must not hold up a shutdown), then close
    the exporters when that worked."""
    if await asyncio.to_thread(provider.force_flush, int(timeout_s * 1000)):
        await asyncio.to_thread(provider.shutdown)
