"""Every bus message survives encode -> decode unchanged; errors survive headers; subjects are sane."""
from __future__ import annotations

import orjson
import pytest

from moebus.shared.codec import Message
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import (
    AbortRequest,
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    HealthReply,
    Heartbeat,
    KVInfo,
    KVTransferSpec,
    Load,
    RenderReply,
    RenderRequest,
    SamplingOptions,
    StructuredOptions,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    WorkerLost,
)
from moebus.shared.subjects import Subjects, check_token

EXAMPLES: list[Message] = [
    GenerateRequest(request_id="gen-1", model="smollm2", prompt_token_ids=[1, 2, 3], reply_to="a.b.c",
                    params=SamplingOptions(n=2, temperature=0.7, top_p=0.9, top_k=40, seed=7, max_tokens=None,
                                           stop=["\n\n", "日本"], logprobs=3,
                                           structured=StructuredOptions(json_schema={"type": "object"})),
                    attempt=2, exclude_workers=["worker-0"], stage="prefill", kv_transfer=KVTransferSpec(
                        transfer_id="gen-1#2", prefill_worker="prefill-0", decode_worker="decode-0",
                        address="moebus.v1.kvtransfer.push.decode-0")),
    GenerateAccepted(request_id="gen-1", worker_id="worker-1", attempt=1),
    GenerateAccepted(request_id="gen-1", worker_id="prefill-0", decode_worker_id="decode-0"),
    Handoff(request_id="gen-1", attempt=2, first_token=42, kv_sent=True),
    TokenChunk(request_id="gen-1", worker_id="w", index=1, seq=5, token_ids=[9, 10], text="hé",
               logprobs=[TokenLogprob(token_id=9, token="h", logprob=-0.5,
                                      top=[TopLogprob(token_id=9, token="h", logprob=-0.5)])],
               finished=True, finish_reason="length", num_prompt_tokens=12, num_cached_tokens=8),
    TokenChunk(request_id="gen-1", worker_id="w", finished=True, error="worker_lost", error_message="x",
               retryable=True),
    AbortRequest(request_id="gen-1", reason="client"),
    RenderRequest(model="m", messages=[ChatMessage(role="user", content="hi", name="bob")]),
    RenderRequest(model="m", prompt="once upon", add_generation_prompt=False, max_prompt_tokens=8192),
    RenderRequest(model="m", prompt_token_ids=[5, 6], max_prompt_tokens=8192),
    RenderReply(prompt_token_ids=[1, 2], prompt_text="hi", eos_token_ids=[2]),
    DetokenizeRequest(model="m", token_ids=[1, 2, 3], read_offset=2, held="\n", stop=["\n\n"], finished=True),
    DetokenizeReply(text="ab", held="c", prefix_offset=1, read_offset=3, stopped=True),
    Heartbeat(service="worker", instance_id="decode-0", ts=1.5, interval_s=1.0, role="decode",
              kv=KVInfo(namespace="smollm2|float32|16", block_size=16, transfer_address="moebus.v1.kvtransfer.push.d")),
    Heartbeat(service="worker", instance_id="worker-0", ts=1.5, interval_s=1.0, draining=True, model="m",
              load=Load(num_running=3, num_waiting=2, max_waiting=8, kv_blocks_free=10, kv_blocks_total=64)),
    HealthReply(service="tokenizer", instance_id="t-0", ready=True, uptime_s=3.25),
    WorkerLost(worker_id="worker-3", reason="missed heartbeats"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = msg.encode()
    assert isinstance(data, bytes)
    back = type(msg).decode(data)
    assert back == msg
    assert back.encode() == data


def test_defaults_are_not_sent_and_unknown_fields_are_ignored() -> None:
    data = AbortRequest(request_id="r").encode()
    assert orjson.loads(data) == {"request_id": "r"}
    newer = orjson.dumps({"request_id": "r", "from_the_future": 1})
    assert AbortRequest.decode(newer) == AbortRequest(request_id="r")


def test_render_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValueError):
        RenderRequest(model="m")
    with pytest.raises(ValueError):
        RenderRequest(model="m", prompt="x", messages=[])
    with pytest.raises(ValueError):
        RenderRequest(model="m", prompt="x", prompt_token_ids=[1])


def test_error_headers_round_trip() -> None:
    err = ServiceError(ErrorCode.OVERLOADED, "queue\nfull", param="n", retry_after=2.5)
    back = ServiceError.from_headers(err.to_headers())
    assert (back.code, back.message, back.param, back.retry_after) == (ErrorCode.OVERLOADED, "queue full", "n", 2.5)
    assert back.retryable
    assert ServiceError.from_headers({"other": "x"}) is None
    assert ServiceError("made-up-code").code is ErrorCode.INTERNAL
    assert not any(k.startswith(("Nats-", "$")) for k in err.to_headers())


def test_subjects() -> None:
    s = Subjects()
    assert s.worker_generate("worker-0") == "moebus.v1.worker.generate.worker-0"
    assert s.frontend_stream("f-1", "gen-9") == "moebus.v1.frontend.stream.f-1.gen-9"
    assert s.heartbeat_all("worker") == "moebus.v1.worker.heartbeat.*"
    assert s.tokenizer_render == "moebus.v1.tokenizer.render"
    for bad in ("a.b", "a b", "*", ">", "Upper", ""):
        with pytest.raises(ValueError):
            check_token(bad)
