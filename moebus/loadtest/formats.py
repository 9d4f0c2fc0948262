"""Trace readers: Mooncake/Kimi JSONL, Azure LLM inference CSV, BurstGPT CSV, aiperf-style JSONL.

Each returns TraceRequests with arrival times relative to the file's first request; a bad row is
a TraceError naming the file and line. `read_trace(path)` guesses the format from the header.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from .trace import TraceError, TraceRequest

FORMATS = ("mooncake", "azure", "burstgpt", "aiperf")


def read_trace(path: str | Path, fmt: str = "auto") -> list[TraceRequest]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    fmt = detect_format(path) if fmt == "auto" else fmt
    readers: dict[str, Callable[[Path], list[TraceRequest]]] = {
        "mooncake": read_mooncake, "azure": read_azure, "burstgpt": read_burstgpt, "aiperf": read_aiperf}
    if fmt not in readers:
        raise TraceError(f"{path}: unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    reqs = readers[fmt](path)
    if not reqs:
        raise TraceError(f"{path}: no requests in the trace")
    t0 = min(r.arrival_s for r in reqs)
    for r in reqs:
        r.arrival_s -= t0
    return reqs


def detect_format(path: Path) -> str:
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:1: not JSON: {e}") from None
        if "input_length" in row or "hash_ids" in row:
            return "mooncake"
        if {"text_input", "messages", "text"} & row.keys():
            return "aiperf"
        raise TraceError(f"{path}:1: JSONL row with neither input_length/hash_ids nor text_input/messages")
    header = {h.strip() for h in first.split(",")}
    if "ContextTokens" in header:
        return "azure"
    if "Request tokens" in header:
        return "burstgpt"
    raise TraceError(f"{path}:1: unknown trace header {first.strip()[:80]!r}")


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{n}: expected a JSON object")
            yield n, row


def _csv(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)}")
        for row in reader:
            yield reader.line_num, row


def _int(path: Path, n: int, row: dict, key: str, default: Any = None) -> int:
    v = row.get(key, default)
    if v is None:
        raise TraceError(f"{path}:{n}: missing {key!r}")
    try:
        i = int(float(v)) if isinstance(v, str) else v
    except ValueError:
        raise TraceError(f"{path}:{n}: {key!r} is not a number: {v!r}") from None
    if not isinstance(i, int) or isinstance(i, bool) or i < 0:
        raise TraceError(f"{path}:{n}: {key!r} must be a non-negative integer, got {v!r}")
    return i


def _float(path: Path, n: int, row: dict, key: str) -> float:
    v = row.get(key)
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{n}: {key!r} is not a number: {v!r}") from None
    if x != x or x < 0:
        raise TraceError(f"{path}:{n}: {key!r} must be >= 0, got {v!r}")
    return x


def read_mooncake(path: Path) -> list[TraceRequest]:
    out = []
    for n, row in _jsonl(path):
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceError(f"{path}:{n}: 'hash_ids' must be a list of integers")
        out.append(TraceRequest(_float(path, n, row, "timestamp") / 1000.0, _int(path, n, row, "input_length"),
                                _int(path, n, row, "output_length"), list(ids), line=n))
    return out


def _wall_clock(path: Path, n: int, v: str | None) -> float:
    if not v:
        raise TraceError(f"{path}:{n}: missing 'TIMESTAMP'")
    head, _, frac = v.strip().partition(".")
    try:
        t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
        return t + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceError(f"{path}:{n}: 'TIMESTAMP' is not 'YYYY-MM-DD HH:MM:SS[.f]': {v!r}") from None


def read_azure(path: Path) -> list[TraceRequest]:
    return [TraceRequest(_wall_clock(path, n, row.get("TIMESTAMP")), _int(path, n, row, "ContextTokens"),
                         _int(path, n, row, "GeneratedTokens"), line=n)
            for n, row in _csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))]


def read_burstgpt(path: Path) -> list[TraceRequest]:
    return [TraceRequest(_float(path, n, row, "Timestamp"), _int(path, n, row, "Request tokens"),
                         _int(path, n, row, "Response tokens"), line=n)
            for n, row in _csv(path, ("Timestamp", "Request tokens", "Response tokens"))]


def read_aiperf(path: Path) -> list[TraceRequest]:
    """Rows with `text_input` (or `text`) or `messages`; optional `timestamp` (ms), else `delay`
    (ms after the previous row), else all at once; optional `output_length` / `max_tokens`."""
    out: list[TraceRequest] = []
    t = 0.0
    for n, row in _jsonl(path):
        text = row.get("text_input", row.get("text"))
        msgs = row.get("messages")
        if isinstance(text, list):  # aiperf's `texts`-style single entry
            text = " ".join(map(str, text))
        if text is None and msgs is None:
            raise TraceError(f"{path}:{n}: a row needs 'text_input' or 'messages'")
        if text is not None and not isinstance(text, str):
            raise TraceError(f"{path}:{n}: 'text_input' must be a string")
        if msgs is not None and (not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m
                                                                       for m in msgs)):
            raise TraceError(f"{path}:{n}: 'messages' must be a list of {{role, content}} objects")
        if "timestamp" in row:
            t = _float(path, n, row, "timestamp") / 1000.0
        elif "delay" in row:
            t += _float(path, n, row, "delay") / 1000.0
        n_out = _int(path, n, row, "output_length", row.get("max_tokens", 128))
        out.append(TraceRequest(t, 0, n_out, text=text if msgs is None else None, messages=msgs, line=n))
    return out
