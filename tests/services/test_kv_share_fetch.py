"""kv_share's tier fetch (WorkerKVLink.fetch) asks the KV broker (`kvbroker.get`) only for blocks
the broker's own KV events say its tiers hold: through real workers (in-process WorkerService, real
SmolLM2 engines), a real KV broker and nats-server, a prompt the broker does not hold costs no bus
round trip, and one another worker shared is fetched, hit in the prefix cache and gives the same
greedy tokens."""
from __future__ import annotations

import asyncio
import time
import uuid

import nats
import pytest

from moebus.shared.messages import (
    BROKER_HOLDER,
    GenerateAccepted,
    GenerateRequest,
    KVEvent,
    SamplingOptions,
    TokenChunk,
)

from .conftest import wait_for

pytest.importorskip("torch")
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 4}
GREEDY = SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [100 + (i * 37) % 4000 for i in range(90)]  # token ids: several full blocks, no tokenizer needed
OTHER = [300 + (i * 53) % 4000 for i in range(90)]


async def test_broker_view_follows_only_the_brokers_events() -> None:
    from moebus.services.worker.config import WorkerConfig
    from moebus.services.worker.kv_link import WorkerKVLink

    link = WorkerKVLink(WorkerConfig(model="toy", kv_broker_ttl_s=5), None, "w0", None, None)  # type: ignore[arg-type]
    await link._on_kv_event(KVEvent(holder="worker-1", tier="cpu", stored=[1, 2, 3]), None)  # type: ignore[arg-type]
    assert link.broker_run([1, 2, 3]) == 0  # another worker's blocks: the balancers' business
    await link._on_kv_event(KVEvent(holder=BROKER_HOLDER, tier="cpu", stored=[1, 2, 4]), None)  # type: ignore[arg-type]
    assert link.broker_run([1, 2, 3]) == 2 and link.broker_run([3, 1]) == 0
    await link._on_kv_event(KVEvent(holder=BROKER_HOLDER, tier="cpu", evicted=[1]), None)  # type: ignore[arg-type]
    assert link.broker_run([1, 2]) == 0 and link.broker_run([2]) == 1
    link.shared.apply(KVEvent(holder=BROKER_HOLDER, tier="cpu", stored=[7], snapshot=True), time.monotonic() - 6)
    assert link.broker_run([7]) == 0  # silent past kv_broker_ttl_s: forgotten, asked nothing


async def generate(worker, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """Greedy tokens of `prompt` on this worker, and the prompt tokens its prefix cache had."""
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_chunk(chunk: TokenChunk, _msg) -> None:
        chunks.append(chunk)
        if chunk.finished or chunk.error:
            done.set()

    reply_to = f"{worker.cfg.subject_prefix}.test.stream.{rid}"
    sub = await worker.bus.subscribe(reply_to, TokenChunk, on_chunk, concurrent=False, traced=False)
    req = GenerateRequest(request_id=rid, model="smollm2", prompt_token_ids=prompt, params=GREEDY, reply_to=reply_to)
    await worker.bus.request(worker.subjects.worker_generate(worker.instance_id), req, GenerateAccepted, 5)
    await asyncio.wait_for(done.wait(), 120)
    await sub.unsubscribe()
    assert not any(c.error for c in chunks), [c.error_message for c in chunks]
    return [t for c in chunks for t in c.token_ids], chunks[0].num_cached_tokens


async def test_fetch_asks_the_broker_only_for_what_it_holds(nats_server) -> None:
    try:
        from moebus.text.gguf import embedded_gguf_path

        embedded_gguf_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not available")
    from moebus.services.kvbroker import KVBrokerConfig, KVBrokerService
    from moebus.services.worker import WorkerConfig, WorkerService

    common = {"nats_url": nats_server.url, "subject_prefix": f"t{uuid.uuid4().hex[:8]}.moebus.v1",
              "heartbeat_interval_s": 0.25}

    def worker_cfg(i: str) -> WorkerConfig:
        return WorkerConfig(model="smollm2", instance_id=i, engine=ENGINE, kv_cpu_bytes=64 << 20, kv_share=True,
                            torch_threads=1, **common)

    gets: list[bytes] = []  # every kvbroker.get on the bus (this subscriber never answers)
    watcher = await nats.connect(nats_server.url)
    broker_cfg = KVBrokerConfig(instance_id="kvbroker-0", cpu_bytes=256 << 20, snapshot_s=0.3,
                                expire_interval_s=0.1, **common)
    try:
        async with KVBrokerService(broker_cfg) as broker, WorkerService(worker_cfg("worker-a")) as a:
            async def count(msg) -> None:
                gets.append(msg.data)

            await watcher.subscribe(broker.subjects.kvbroker_get, cb=count)
            await watcher.flush()
            await wait_for(lambda: a.ready, timeout=180)
            bs, ns = a.kv.block_size, a.kv.namespace
            n = (len(PROMPT) - 1) // bs
            hashes = GenerateRequest(request_id="h", model="smollm2", prompt_token_ids=PROMPT,
                                     reply_to="-").block_hashes_in(bs, ns)[:n]
            assert n >= 3

            # (a) Nothing of this prompt is in the broker's tiers: no get, counted as skipped.
            want, cached = await generate(a, PROMPT, "a-1")
            await watcher.flush()
            assert cached == 0 and a.link.counters["tier_fetch_skipped"] == 1
            assert a.link.counters["tier_fetched_blocks"] == 0 and gets == [] and broker.counters["gets"] == 0

            # A offloads the prompt's blocks and shares them with the broker.
            await wait_for(lambda: broker.store.longest_prefix(hashes) == n, timeout=30)

            # (b) A fresh worker learns them from the broker's events and fetches them.
            async with WorkerService(worker_cfg("worker-b")) as b:
                await wait_for(lambda: b.ready, timeout=180)
                await wait_for(lambda: b.link.broker_run(hashes) == n, timeout=10)  # (its next snapshot)
                got, cached = await generate(b, PROMPT, "b-1")
                assert got == want and cached == n * bs
                assert b.link.counters["tier_fetched_blocks"] == n and b.link.counters["tier_fetch_skipped"] == 0
                assert len(gets) == 1 and broker.counters["gets"] == 1

                # ... and asks nothing for a prompt the broker does not hold.
                await generate(b, OTHER, "b-2")
                await watcher.flush()
                assert b.link.counters["tier_fetch_skipped"] == 1 and len(gets) == 1 and broker.counters["gets"] == 1
    finally:
        await watcher.close()
