"""A run's folder: requests.jsonl (one RequestRecord a line, written as each finishes),
meta.json (what was run), summary.json, and the plots (*.png)."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from .client import RequestRecord

REQUESTS, META, SUMMARY = "requests.jsonl", "meta.json", "summary.json"
_FIELDS = {f.name for f in fields(RequestRecord)}


class RecordSink:
    """Appends records to requests.jsonl as they finish (flushed: an interrupted run keeps them)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._f = (run_dir / REQUESTS).open("w", encoding="utf-8")

    def __call__(self, rec: RequestRecord) -> None:
        self._f.write(json.dumps(rec.to_json()) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_records(run_dir: Path) -> list[RequestRecord]:
    out = []
    with (run_dir / REQUESTS).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(RequestRecord(**{k: v for k, v in row.items() if k in _FIELDS}))
    return sorted(out, key=lambda r: r.index)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
