"""`moebus trace <request-id | trace-id>`: one request's timeline across services, as a waterfall,
from the JSONL spans the services export (trace_export.py, `moebus up --trace-file`).

The id may be a trace id (`X-Trace-Id` of the response), the HTTP request's id (`X-Request-Id`,
span attribute moebus.request_id) or a generation's id on the bus (moebus.generation_id). Each
line: start offset and duration (ms), the process (instance id), the span (indented under its parent), a bar on
the request's time axis, and the span's key attributes.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import orjson

from .trace_export import TRACE_FILE_ENV

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_ID_KEYS = ("moebus.request_id", "moebus.generation_id")
# Attributes worth a glance, in this order; shown without their namespace.
KEY_ATTRS = ("http.response.status_code", "gen_ai.request.model", "gen_ai.usage.input_tokens",
             "gen_ai.usage.output_tokens", "gen_ai.server.time_to_first_token", "gen_ai.response.finish_reasons",
             "moebus.stage", "moebus.worker_id", "moebus.decode_worker_id", "moebus.prefill_worker_id", "moebus.route.reason",
             "moebus.route.policy", "moebus.cached_tokens", "moebus.batch", "moebus.decode.steps", "moebus.kv.bytes",
             "moebus.kv.ok", "moebus.handed_over", "moebus.detokenize.calls", "moebus.reason", "moebus.failed_worker",
             "moebus.attempt", "moebus.outcome", "moebus.encoder.cache_hits", "moebus.images")
BAR = 32


def read_spans(path: str) -> Iterator[dict[str, Any]]:
    """Every span in the file (a torn last line, from a process killed mid-write, is skipped)."""
    with open(path, "rb") as f:
        for line in f:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue


def find_traces(spans: Iterable[dict[str, Any]], ident: str) -> dict[str, list[dict[str, Any]]]:
    """trace id -> its spans, for the traces `ident` names (a trace id, request id or generation id)."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    wanted: set[str] = set()
    ident_l = ident.lower()
    for s in spans:
        by_trace[s["trace_id"]].append(s)
        attrs = s.get("attributes") or {}
        if s["trace_id"] == ident_l or any(attrs.get(k) == ident for k in _ID_KEYS):
            wanted.add(s["trace_id"])
    return {t: by_trace[t] for t in sorted(wanted, key=lambda t: min(s["start_ns"] for s in by_trace[t]))}


def _ordered(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Depth-first from the roots (spans whose parent is not in the trace), children by start time."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        children[s["parent_id"] if s["parent_id"] in ids else None].append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children[parent], key=lambda s: (s["start_ns"], s["end_ns"])):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return out


def _who(span: dict[str, Any]) -> str:
    """The process: its instance id (worker ids say prefill or decode), else its service."""
    return span.get("instance") or (span.get("service") or "?").removeprefix("moebus-")


def _short(key: str) -> str:
    for ns in ("moebus.", "gen_ai.usage.", "gen_ai.response.", "gen_ai.request.", "gen_ai.server.", "http.response."):
        if key.startswith(ns):
            return key[len(ns):]
    return key


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    return str(v)


def render(trace_id: str, spans: list[dict[str, Any]], out: TextIO, width: int = BAR) -> None:
    t0 = min(s["start_ns"] for s in spans)
    total = max(max(s["end_ns"] for s in spans) - t0, 1)
    services = sorted({(s.get("service") or "?").removeprefix("moebus-") for s in spans})
    out.write(f"trace {trace_id}: {len(spans)} spans, {total / 1e6:.1f} ms, services: {', '.join(services)}\n")
    rows = _ordered(spans)
    name_w = max(len("  " * d + s["name"]) for d, s in rows)
    who_w = max(len("process"), *(len(_who(s)) for s in spans))
    out.write(f"{'start ms':>9} {'dur ms':>9}  {'process':<{who_w}} {'span':<{name_w}}  {'':<{width}}  attributes\n")
    for depth, s in rows:
        start, dur = s["start_ns"] - t0, s["end_ns"] - s["start_ns"]
        a = int(start / total * width)
        b = max(a + 1, int((start + dur) / total * width))
        bar = " " * a + "#" * (min(b, width) - a)
        attrs = s.get("attributes") or {}
        keys = " ".join(f"{_short(k)}={_value(attrs[k])}" for k in KEY_ATTRS if attrs.get(k) not in (None, "", "aggregated")
                        and (k != "moebus.attempt" or attrs[k]))  # (a first attempt is not news)
        if s.get("status") == "ERROR":
            keys = "ERROR " + keys
        if s.get("events"):
            keys += f" events={len(s['events'])}"
        out.write(f"{start / 1e6:9.2f} {dur / 1e6:9.2f}  {_who(s):<{who_w}} {'  ' * depth + s['name']:<{name_w}}  "
                  f"{bar:<{width}}  {keys}\n".rstrip() + "\n")


def show(ident: str, path: str, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    traces = find_traces(read_spans(path), ident)
    if not traces:
        print(f"no trace for {ident!r} in {path}", file=sys.stderr)
        return 1
    for i, (trace_id, spans) in enumerate(traces.items()):
        if i:
            out.write("\n")
        render(trace_id, spans, out)
    return 0


def _trace(args: argparse.Namespace) -> int:
    path = args.file or os.environ.get(TRACE_FILE_ENV)
    if not path:
        print(f"give --file (the JSONL of `moebus up --trace-file`) or set ${TRACE_FILE_ENV}", file=sys.stderr)
        return 2
    if not os.path.exists(path):
        print(f"{path}: no such file", file=sys.stderr)
        return 2
    return show(args.id, path)


def add_cli_command(subparsers: argparse._SubParsersAction) -> None:
    t = subparsers.add_parser("trace", help="one request's timeline across services, from exported spans",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("id", help="trace id (X-Trace-Id), request id (X-Request-Id) or generation id")
    t.add_argument("--file", default=None, help=f"the spans (JSONL); default ${TRACE_FILE_ENV}")
    t.set_defaults(func=_trace)
