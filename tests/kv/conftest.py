"""Fixtures: two real SmolLM2 engines (prefill A, decode B), a nats-server per module, prompts."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams
from moebus.kv.payload import KVPayload
from moebus.kv.transports.shm import ShmKVTransport, ShmTransportConfig
from moebus.shared.nats_server import NatsServer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Two intra-op threads on two shared cores run the small model far slower than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(**kw: object) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = {"model": "smollm2", "num_kv_blocks": 96, "block_size": BLOCK, "max_num_batched_tokens": 512, **kw}
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="session")
def engine_a() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def engine_b() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def prompt(engine_a: LLMEngine) -> list[int]:
    """~60 tokens: three full blocks and a partial one."""
    text = "Prefill and decode run on different workers. The decode worker receives the KV cache "
    ids = engine_a.tokenizer.encode(text * 3)
    assert 48 < len(ids) < 96
    return ids


@pytest.fixture(scope="session")
def long_prompt(engine_a: LLMEngine) -> list[int]:
    text = "A tiered KV cache keeps computed attention keys and values in host memory and on disk. "
    return engine_a.tokenizer.encode(text * 20)[:400]


@dataclass
class Run:
    tokens: list[int]
    ttft_s: float
    computed: int  # tokens the engine ran through the model for this run


def run(engine: LLMEngine, rid: str, prompt: list[int] | None = None, params: SamplingParams = GREEDY,
        before_step: Callable[[], None] | None = None, after_step: Callable[[], None] | None = None) -> Run:
    """Add (unless already added) and drive one request to the end; time to its first output."""
    t0 = time.perf_counter()
    computed0 = engine.stats_.tokens_computed
    if prompt is not None:
        engine.add_request(rid, prompt, params)
    if before_step is not None:
        before_step()
    tokens: list[int] = []
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                tokens += out.new_token_ids
        if after_step is not None:
            after_step()
    return Run(tokens, ttft or 0.0, engine.stats_.tokens_computed - computed0)


@pytest.fixture(scope="session")
def reference(engine_b: LLMEngine, prompt: list[int]) -> list[int]:
    """Greedy tokens of `prompt` on one aggregated engine."""
    engine_b.block_manager.reset_prefix_cache()
    out = run(engine_b, "reference", prompt).tokens
    engine_b.block_manager.reset_prefix_cache()
    return out


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer(jetstream=False) as server:
        yield server


def over_shm(payload: KVPayload, address: str, tag: str) -> KVPayload:
    """`payload` sent through the shared-memory transport to a receiver at `address`, as received."""
    async def go() -> KVPayload:
        rx, tx = ShmKVTransport(ShmTransportConfig(address=address)), ShmKVTransport()
        await tx.send(payload, rx.address, tag)
        return await rx.receive(tag, 5)
    return asyncio.run(go())
