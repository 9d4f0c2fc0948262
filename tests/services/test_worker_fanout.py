"""n > 1 through a real worker (in-process WorkerService, real SmolLM2 engine, real NATS): the
engine fans the choices out, so the prompt's KV blocks are allocated once and shared, and each
choice streams the tokens the old per-choice engine requests (seed + i) gave."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from moebus.shared.messages import GenerateAccepted, GenerateRequest, SamplingOptions, TokenChunk

from .conftest import wait_for

pytest.importorskip("torch")
N, SEED, MAX_TOKENS = 4, 11, 8
ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 8}
OPTIONS = SamplingOptions(n=N, temperature=0.8, top_p=0.95, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    """The prompt, and the tokens of the old way: n engine requests seeded seed + i, added at once."""
    try:
        from moebus.text.gguf import embedded_gguf_path

        embedded_gguf_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not available")
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2", **ENGINE))
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a colour and a fruit."}]))
    for i in range(N):
        engine.add_request(f"old#{i}", prompt, SamplingParams(
            **OPTIONS.model_dump(exclude={"n", "seed", "structured"}), seed=SEED + i))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(int(out.request_id.rpartition("#")[2]), []).extend(out.new_token_ids)
    engine.close()
    return prompt, tokens, engine.block_manager.block_size


async def test_n_choices_share_prompt_blocks_and_keep_per_choice_outputs(nats_server, reference) -> None:
    from moebus.services.worker import WorkerConfig, WorkerService

    prompt, old, bs = reference
    cfg = WorkerConfig(model="smollm2", nats_url=nats_server.url, subject_prefix=f"t{uuid.uuid4().hex[:8]}.moebus.v1",
                       instance_id="worker-fan", engine=ENGINE, heartbeat_interval_s=0.25)
    async with WorkerService(cfg) as worker:
        await wait_for(lambda: worker.ready, timeout=120)
        before = dict(worker.stats()["engine"])
        chunks: list[TokenChunk] = []
        done = asyncio.Event()

        async def on_chunk(chunk: TokenChunk, _msg) -> None:
            chunks.append(chunk)
            if sum(c.finished for c in chunks) == N or chunk.error:
                done.set()

        reply_to = f"{cfg.subject_prefix}.test.stream.fan"
        await worker.bus.subscribe(reply_to, TokenChunk, on_chunk, concurrent=False, traced=False)
        req = GenerateRequest(request_id="fan", model="smollm2", prompt_token_ids=prompt, params=OPTIONS,
                              reply_to=reply_to)
        await worker.bus.request(worker.subjects.worker_generate(worker.instance_id), req, GenerateAccepted, 5)
        await asyncio.wait_for(done.wait(), 120)
        await wait_for(lambda: worker._loop.stats.get("num_running") == 0, timeout=10)
        after = worker.stats()["engine"]

    assert not any(c.error for c in chunks), [c.error_message for c in chunks if c.error]
    tokens: dict[int, list[int]] = {}
    first_cached: dict[int, int] = {}
    for c in chunks:
        tokens.setdefault(c.index, []).extend(c.token_ids)
        first_cached.setdefault(c.index, c.num_cached_tokens)
        assert c.request_id == "fan"
    assert tokens == old  # each choice equals the old per-choice request seeded seed + i
    assert [c.seq for c in chunks if c.index == 2] == list(range(MAX_TOKENS))
    # The prompt's full blocks were allocated once: the other choices found them in the prefix cache.
    shared = (len(prompt) - 1) // bs
    assert first_cached == {0: 0, **{i: shared * bs for i in range(1, N)}}
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == N - 1
    per_choice = -(-(len(prompt) + MAX_TOKENS - 1) // bs)  # the last sampled token is never computed
    assert after["kv_blocks_allocated"] - before["kv_blocks_allocated"] == N * per_choice - (N - 1) * shared
    assert worker.counters["accepted"] == 1 and worker.counters["finished"] == 1
