"""Trace readers: each format, auto-detection, and bad rows naming the file and line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebus.loadtest.formats import detect_format, read_trace
from moebus.loadtest.trace import TraceError

AZURE = Path(__file__).parent / "data" / "azure_code_2023_head40.csv"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_azure_slice() -> None:
    reqs = read_trace(AZURE)
    assert len(reqs) == 40 and detect_format(AZURE) == "azure"
    assert reqs[0].arrival_s == 0 and (reqs[0].input_tokens, reqs[0].output_tokens) == (4808, 10)
    # 18:17:03.9799600 -> 18:17:04.0319600: 52 ms, to the microsecond
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    assert not any(r.hash_ids for r in reqs)


def test_mooncake(tmp_path: Path) -> None:
    p = write(tmp_path, "m.jsonl", jsonl([
        {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]}]))
    reqs = read_trace(p)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]
    assert reqs[1].hash_ids == [0, 3] and reqs[1].input_tokens == 600


def test_burstgpt(tmp_path: Path) -> None:
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                 "5,ChatGPT,472,18,490,Conversation log\n7.5,GPT-4,1000,0,1000,API log\n")
    reqs = read_trace(p)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [(0, 472, 18), (2.5, 1000, 0)]


def test_aiperf_text_and_messages(tmp_path: Path) -> None:
    p = write(tmp_path, "a.jsonl", jsonl([
        {"text_input": "Hello there", "output_length": 7},
        {"messages": [{"role": "user", "content": "Hi"}], "delay": 250},
        {"text_input": "later", "timestamp": 2000}]))
    reqs = read_trace(p, "aiperf")
    assert reqs[0].text == "Hello there" and reqs[0].output_tokens == 7
    assert reqs[1].messages == [{"role": "user", "content": "Hi"}] and reqs[1].arrival_s == 0.25
    assert reqs[2].arrival_s == 2.0 and reqs[2].output_tokens == 128


@pytest.mark.parametrize(("name", "text", "fmt", "where", "what"), [
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": -3, '
                '"output_length": 1}\n', "auto", ":2:", "input_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{oops\n', "mooncake", ":3:", "not JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}\n', "auto", ":1:",
     "hash_ids"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\nyesterday,10,2\n", "auto",
     ":3:", "TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,ten,2\n", "azure", ":2:",
     "ContextTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.97,10\n", "azure", ":1:", "GeneratedTokens"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\n1,2,3\n,2,3\n", "auto", ":3:", "Timestamp"),
    ("p.jsonl", '{"text_input": "ok"}\n{"prompt": "no"}\n', "aiperf", ":2:", "text_input"),
    ("p.jsonl", '{"messages": "hi"}\n', "aiperf", ":1:", "messages"),
    ("x.csv", "a,b,c\n1,2,3\n", "auto", ":1:", "unknown trace header"),
])
def test_bad_rows_name_file_and_line(tmp_path: Path, name: str, text: str, fmt: str, where: str, what: str) -> None:
    p = write(tmp_path, name, text)
    with pytest.raises(TraceError) as e:
        read_trace(p, fmt)
    assert str(p) + where in str(e.value) and what in str(e.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path, "e.csv", "Timestamp,Request tokens,Response tokens\n"))
