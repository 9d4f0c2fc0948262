"""Prefill on engine A, move the KV, decode on engine B: same tokens as one aggregated engine."""
from __future__ import annotations

import asyncio

import nats
import pytest

from moebus.engine.sampling import SamplingParams
from moebus.kv.hashing import kv_namespace
from moebus.kv.transfer import extract_kv, inject_prefilled, prefill
from moebus.kv.transports.nats import NatsKVTransport
from moebus.kv.transports.shm import ShmKVTransport, ShmTransportConfig
from moebus.kv.transports.transport import KVTransferTimeout

from .conftest import GREEDY, run


async def _transfer(kind: str, payload, url: str):
    if kind == "shm":
        rx, tx = ShmKVTransport(ShmTransportConfig(address="moebus-kv-disagg")), ShmKVTransport()
        await tx.send(payload, rx.address, "req-1#0")
        return await rx.receive("req-1#0", 5)
    a, b = await nats.connect(url), await nats.connect(url)
    try:
        rx = await NatsKVTransport(b, "moebus.v1.kvtransfer.push.decode-0").start()
        await NatsKVTransport(a, None).send(payload, rx.address, "req-1#0")
        return await rx.receive("req-1#0", 5)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("kind", ["nats", "shm"])
def test_disaggregated_matches_aggregated(engine_a, engine_b, prompt, reference, nats_server, kind):
    engine_b.block_manager.reset_prefix_cache()
    pre = prefill(engine_a, f"p-{kind}", prompt, GREEDY)
    assert pre.payload is not None and pre.payload.num_tokens == len(prompt)
    assert pre.first_token == reference[0] and not engine_a.has_unfinished_requests()
    got = asyncio.run(_transfer(kind, pre.payload, nats_server.url))
    assert got.equal(pre.payload)
    res = inject_prefilled(engine_b, f"d-{kind}", prompt, pre.first_token, GREEDY, got)
    assert res.injected and res.num_tokens == len(prompt) and res.num_copied_blocks == -(-len(prompt) // 16)
    out = run(engine_b, f"d-{kind}")
    assert [pre.first_token] + out.tokens == reference
    assert out.computed == GREEDY.max_tokens - 1  # decode steps only: no prompt recompute
    assert engine_b.block_manager.num_free_blocks == len(engine_b.block_manager.blocks)
    # The injected prompt blocks are now ordinary prefix-cache entries on B.
    assert run(engine_b, f"again-{kind}", prompt).tokens == reference
    engine_b.block_manager.reset_prefix_cache()


def test_seeded_sampling_continues_the_same_stream(engine_a, engine_b, prompt):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=5)
    engine_b.block_manager.reset_prefix_cache()
    aggregated = run(engine_b, "seeded-agg", prompt, params).tokens
    engine_b.block_manager.reset_prefix_cache()
    pre = prefill(engine_a, "seeded-p", prompt, params)
    assert pre.payload.generator_state is not None
    inject_prefilled(engine_b, "seeded-d", prompt, pre.first_token, params, pre.payload)
    assert [pre.first_token] + run(engine_b, "seeded-d").tokens == aggregated
    engine_b.block_manager.reset_prefix_cache()


def test_lost_or_bad_payload_falls_back_to_recompute(engine_a, engine_b, prompt, reference):
    engine_b.block_manager.reset_prefix_cache()

    async def lost():  # the prefill worker died mid-transfer: nothing arrives
        return await ShmKVTransport(ShmTransportConfig(address="moebus-kv-lost")).receive("gone", 0.05)

    with pytest.raises(KVTransferTimeout):
        asyncio.run(lost())
    res = inject_prefilled(engine_b, "lost", prompt, reference[0], GREEDY, None)
    assert not res.injected and res.reason == "no payload"
    out = run(engine_b, "lost")
    assert [reference[0]] + out.tokens == reference
    assert out.computed == len(prompt) + GREEDY.max_tokens - 1  # prompt + first token recomputed
    engine_b.block_manager.reset_prefix_cache()

    pre = prefill(engine_a, "other", prompt[::-1], GREEDY)  # KV of a different prompt
    res = inject_prefilled(engine_b, "bad", prompt, reference[0], GREEDY, pre.payload)
    assert not res.injected and "prefix" in res.reason
    assert [reference[0]] + run(engine_b, "bad").tokens == reference
    engine_b.block_manager.reset_prefix_cache()


def test_extract_needs_a_live_request_and_first_token_stop_is_refused(engine_a, engine_b, prompt, reference):
    with pytest.raises(KeyError):
        extract_kv(engine_a, "no-such-request")
    one = SamplingParams(temperature=0.0, max_tokens=1)
    pre = prefill(engine_a, "one", prompt, one)  # done at its first token: nothing to move
    assert pre.payload is None and pre.output.finished and pre.first_token == reference[0]
    with pytest.raises(ValueError, match="first token"):
        inject_prefilled(engine_b, "one", prompt, pre.first_token, one, None)
    assert "one" not in engine_b.tracked and not engine_b.has_unfinished_requests()
    assert kv_namespace(engine_a) == kv_namespace(engine_b)


def test_async_scheduling_engine_extracts_and_injects(prompt, reference):
    # Under async scheduling the next step is already in flight when outputs come back: extract
    # must skip its tokens and inject must not disturb it.
    from .conftest import make_engine

    eng = make_engine(async_scheduling=True, num_kv_blocks=32)
    try:
        pre = prefill(eng, "async-p", prompt, GREEDY)
        assert pre.payload.num_tokens == len(prompt) and pre.first_token == reference[0]
        eng.block_manager.reset_prefix_cache()
        while eng.has_unfinished_requests():  # let the aborted request's in-flight step land
            eng.step()
        eng.block_manager.reset_prefix_cache()
        assert inject_prefilled(eng, "async-d", prompt, pre.first_token, GREEDY, pre.payload).injected
        out = run(eng, "async-d")
        # decode steps only (async runs one step past the end before it sees the finish)
        assert [pre.first_token] + out.tokens == reference and out.computed <= GREEDY.max_tokens
    finally:
        eng.close()
