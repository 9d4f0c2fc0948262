"""Spans from real processes: a disaggregated SmolLM2 stack started as `moebus up --trace-file`
does (nats-server, one process per service); one streamed chat request is one trace over the
frontend (which renders the prompt itself: local_render), balancer and both workers, the KV transfer included, its parent links intact
across processes; an unsampled request gives the same text and no spans; `moebus trace` shows it."""
from __future__ import annotations

import io
import time
from contextlib import redirect_stdout

import openai
import pytest

from moebus.cli import main as cli_main
from moebus.shared.trace_view import find_traces, read_spans

from .conftest import real_model_stack

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("torch")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "spans.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the processes export every 0.1 s (default 5 s)
    try:
        for stack in real_model_stack(tmp_path_factory, mode="disaggregated", prefill_workers=1, decode_workers=1,
                                      trace_file=str(path), engine={"num_kv_blocks": 256, "max_num_seqs": 8},
                                      worker={"torch_threads": 1}, ready_timeout_s=240):
            yield stack, str(path)
    finally:
        mp.undo()


async def _stream(stack, **kw) -> tuple[str, dict[str, str]]:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="smollm2", messages=MESSAGES, max_tokens=8,
                                                            temperature=0, stream=True, **kw)
    text = "".join([ch.choices[0].delta.content or "" async for ch in raw.parse() if ch.choices])
    return text, dict(raw.headers)


def _trace(path: str, trace_id: str, names: set[str], timeout: float = 15.0) -> list[dict]:
    """The trace's spans once all of `names` were exported (the processes batch them)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = find_traces(read_spans(path), trace_id).get(trace_id, [])
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


async def test_disaggregated_request_is_one_trace_across_processes(traced_stack) -> None:
    stack, path = traced_stack
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    plain, plain_headers = await _stream(stack, extra_headers={"traceparent": unsampled})
    text, headers = await _stream(stack, extra_headers={"X-Request-Id": "disagg-trace-1"})
    assert text == plain and text  # tracing does not change the output

    want = {"POST /v1/chat/completions", "generate smollm2", "render", "route", "generate", "queue", "prefill",
            "kv.extract", "kv.send", "kv.handoff_wait", "kv.receive", "kv.inject", "decode"}
    spans = _trace(path, headers["x-trace-id"], want)
    assert want <= {s["name"] for s in spans}, sorted({s["name"] for s in spans})
    assert plain_headers["x-trace-id"] == "0af7651916cd43dd8448eb211c80319c"
    assert not find_traces(read_spans(path), plain_headers["x-trace-id"])  # the caller said: not sampled

    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["name"] == "POST /v1/chat/completions" and root["instance"] == "frontend-0"
    for s in spans:  # parent links intact across the five processes
        hop = s
        while hop["parent_id"] is not None:
            hop = by_id[hop["parent_id"]]
        assert hop is root, s["name"]
    where = {}
    for s in spans:
        where.setdefault(s["name"], set()).add(s["instance"])
    assert where["render"] == {"frontend-0"} and where["route"] == {"balancer-0"}
    assert where["generate"] == {"prefill-0", "decode-0"}
    assert where["prefill"] == where["kv.extract"] == where["kv.send"] == {"prefill-0"}
    assert where["kv.receive"] == where["kv.inject"] == where["decode"] == {"decode-0"}
    send = next(s for s in spans if s["name"] == "kv.send")
    receive = next(s for s in spans if s["name"] == "kv.receive")
    assert send["attributes"]["moebus.kv.bytes"] == receive["attributes"]["moebus.kv.bytes"] > 0
    decode = next(s for s in spans if s["name"] == "decode")
    generation = next(s for s in spans if s["name"] == "generate smollm2")["attributes"]
    assert generation["gen_ai.usage.output_tokens"] > 1  # (8 at most)
    # the first token came from the prefill worker
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == generation["gen_ai.usage.output_tokens"] - 1
    assert len(decode["events"]) == decode["attributes"]["moebus.decode.steps"]
    route = next(s for s in spans if s["name"] == "route")
    assert route["attributes"]["moebus.worker_id"] == "prefill-0"
    assert route["attributes"]["moebus.decode_worker_id"] == "decode-0"

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["trace", "disagg-trace-1", "--file", path]) == 0
    shown = out.getvalue()
    print(shown)
    for process in ("frontend-0", "balancer-0", "prefill-0", "decode-0"):
        assert f" {process} " in shown, process
    assert "kv.send" in shown and "kv.bytes=" in shown
