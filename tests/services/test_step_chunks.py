"""A worker sends an engine step's chunks for a frontend as one TokenChunks message."""
from __future__ import annotations

import asyncio

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.worker.outputs import StepChunks
from moebus.shared.errors import ErrorCode
from moebus.shared.messages import TokenChunk, TokenChunks

from .conftest import toy_stack

CHAT = [{"role": "user", "content": "hi"}]


def _chunk(rid: str, seq: int, text: str = "x") -> TokenChunk:
    return TokenChunk(request_id=rid, worker_id="w", seq=seq, token_ids=[seq], text=text)


def test_join_is_the_encoding_of_the_chunks_together() -> None:
    chunks = [_chunk("a", 0), _chunk("b", 3, "é\n\"q\""), TokenChunk(request_id="c", worker_id="w", finished=True,
                                                                   error="engine_failed", error_message="boom")]
    data = TokenChunks.join([c.encode() for c in chunks])
    assert TokenChunks.decode(data).chunks == chunks
    assert TokenChunks.decode(TokenChunks.join([])).chunks == []


def test_step_chunks_group_by_frontend_in_order_and_split_at_the_size_cap() -> None:
    batch = StepChunks(max_bytes=300)
    sent = {"f1": [_chunk(f"r{i}", i, "y" * 40) for i in range(6)], "f2": [_chunk("s", 0)]}
    for i in range(6):
        batch.add("f1", sent["f1"][i].encode())
        if i == 2:
            batch.add("f2", sent["f2"][0].encode())
    messages = list(batch.messages())
    assert [f for f, _ in messages].count("f2") == 1
    f1 = [TokenChunks.decode(d).chunks for f, d in messages if f == "f1"]
    assert len(f1) > 1 and all(len(d) <= 300 + 200 for f, d in messages)  # cut before the cap, one chunk over at most
    assert [c for part in f1 for c in part] == sent["f1"]


async def test_concurrent_streams_share_step_messages(nats_server) -> None:
    """Four streams stepping together: every chunk goes in frontend_chunks messages, and they
    carry more than one stream's chunk at a time; the texts are whole."""
    async with toy_stack(nats_server.url, engine={"step_delay_s": 0.02}) as st:
        worker = st.workers[0]
        publish, seen = worker.bus.publish, []

        async def counting(subject: str, msg, headers=None) -> None:
            if ".frontend." in subject:
                seen.append((subject, len(TokenChunks.decode(msg).chunks) if ".frontend.chunks." in subject else 1))
            await publish(subject, msg, headers)

        worker.bus.publish = counting
        client = st.client()

        async def one() -> str:
            stream = await client.chat.completions.create(model="toy", messages=CHAT, stream=True, max_tokens=200)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(4))), 20)
        assert texts == [TOY_REPLY] * 4
        assert seen and all(".frontend.chunks." in s for s, _ in seen), seen[:5]
        assert max(n for _, n in seen) > 1
        assert len(seen) < sum(n for _, n in seen)


async def test_an_error_chunk_takes_the_step_subject(nats_server) -> None:
    """A request the worker fails mid-stream: its error chunk goes on frontend_chunks too (after
    the request left the worker's table), so it cannot overtake the step messages before it."""
    async with toy_stack(nats_server.url, engine={"step_delay_s": 0.05}) as st:
        worker = st.workers[0]
        publish, seen = worker.bus.publish, []

        async def recording(subject: str, msg, headers=None) -> None:
            if ".frontend." in subject:
                seen.append((subject, TokenChunks.decode(msg).chunks if ".frontend.chunks." in subject else None))
            await publish(subject, msg, headers)

        worker.bus.publish = recording
        stream = await st.client().chat.completions.create(model="toy", messages=CHAT, stream=True, max_tokens=200)
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and (running := worker.active_requests()):
                    worker.fail(running[0].req.request_id, ErrorCode.REQUEST_FAILED, "boom", retryable=False,
                                counter="failed")
        errors = [(s, cs) for s, cs in seen if cs is None or any(c.error for c in cs)]
        assert errors and all(".frontend.chunks." in s for s, _ in errors), errors
