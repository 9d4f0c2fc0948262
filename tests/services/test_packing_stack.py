"""Two real workers sharing the cores, as `moebus up` starts them on a small host: a light burst goes
to one of them (balancer/packing.py), the path from the worker's CoreShare through its heartbeat's
Load to the balancer's order; past pack_rows the other worker is woken."""
from __future__ import annotations

import asyncio

import openai
import pytest

from moebus.services.launcher import Stack

from .conftest import real_model_stack, service_stats

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a two-worker real-model stack: ~1 min to start on a loaded 2-core box


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cores = tmp_path_factory.mktemp("cores")
    yield from real_model_stack(tmp_path_factory, workers=2,
                                worker={"torch_threads": 2, "core_share_dir": str(cores), "pack_rows": 4},
                                engine={"num_kv_blocks": 256, "max_num_seqs": 16}, ready_timeout_s=300)


async def accepted(stack: Stack) -> list[int]:
    return [(await service_stats(stack, "worker", f"worker-{i}"))["accepted"] for i in range(2)]


async def burst(stack: Stack, n: int) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    outs = await asyncio.gather(*(c.completions.create(model="smollm2", prompt=f"Count from {i} to {i + 9}:",
                                                       max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
                                  for i in range(n)))
    assert all(o.usage.completion_tokens == 24 for o in outs)


async def test_a_light_burst_fills_one_worker_then_the_other_is_woken(stack: Stack) -> None:
    await burst(stack, 3)  # under pack_rows (4): one worker takes all three
    first = await accepted(stack)
    assert sorted(first) == [0, 3], first
    await burst(stack, 6)  # the first worker holds 4, then the idle one is woken
    second = [b - a for a, b in zip(first, await accepted(stack), strict=True)]
    assert sum(second) == 6 and min(second) >= 2, second
