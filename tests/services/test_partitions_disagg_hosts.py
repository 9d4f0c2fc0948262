"""A prefill/decode split across hosts loses its KV-transfer path (issue #40 item 2): the prefill
worker on host b and the decode worker on host c can no longer reach each other, while both still
reach the bus node of host a (frontend, tokenizer, balancer): their two NATS nodes lost the route
between them. 20 requests sent during the cut still end with the undisturbed greedy text and token
count (the decode worker takes them over from the tokens streamed: engine/resume.py), each
finishes once, and after the heal the split path (prefill on b, KV to c) works again.
Real model (SmolLM2), real processes, `moebus serve` per host (services/host_stack.py).
"""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from moebus.services.balancer.config import BalancerConfig
from moebus.services.frontend.config import FrontendConfig
from moebus.services.host_stack import HostStack, Process
from moebus.services.netns import available
from moebus.services.tokenizer.config import TokenizerConfig
from moebus.services.worker.config import WorkerConfig

from .conftest import skip_without_smollm2
from .test_migration_stack import ENGINE, MAX_TOKENS, TOPICS, _open

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")
HB = {"heartbeat_interval_s": 0.25}
STREAMS = [*TOPICS, "a lighthouse", "the rain", "a bridge", "an old clock", "the harbour", "a forest path",
           "the first frost", "a kite"]  # 20
WORKERS = ("prefill-b", "decode-c")


def processes() -> list[Process]:
    worker = {"model": "smollm2", "engine": ENGINE, "torch_threads": 1, **HB}
    return [Process("a", "tokenizer", TokenizerConfig(instance_id="tokenizer-a", model="smollm2", **HB)),
            Process("a", "balancer", BalancerConfig(instance_id="balancer-a", mode="disaggregated", **HB)),
            Process("a", "frontend", FrontendConfig(instance_id="frontend-a", port=8000, models=["smollm2"], **HB)),
            Process("b", "worker", WorkerConfig(instance_id="prefill-b", role="prefill", **worker)),
            Process("c", "worker", WorkerConfig(instance_id="decode-c", role="decode", **worker))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    skip_without_smollm2()
    with HostStack(("a", "b", "c"), processes(), str(tmp_path_factory.mktemp("pd-hosts")), ready_timeout_s=300) as s:
        yield s


def outcomes(stack: HostStack) -> dict[str, float]:
    return {f"{w}:{o}": stack.metric(w, "moebus_worker_requests_total", f'outcome="{o}"')
            for w in WORKERS for o in ("finished", "handed_off", "failed", "aborted")}


def run(stack: HostStack, seconds: float) -> dict:
    async def go() -> dict:
        c = openai.AsyncOpenAI(base_url=stack.frontend_url("frontend-a") + "/v1", api_key="none", max_retries=0,
                               timeout=seconds + 240)
        try:
            reference = await asyncio.gather(*(r.rest() for r in await asyncio.gather(*(_open(c, t) for t in STREAMS))))
            await asyncio.to_thread(stack.net.split, "b", "c")
            cut_at = time.monotonic()
            during = await asyncio.gather(*(_open(c, t) for t in STREAMS))
            done = await asyncio.gather(*(r.rest() for r in during))
            done_s = time.monotonic() - cut_at
            await asyncio.sleep(max(0.0, cut_at + seconds - time.monotonic()))  # the split lasts `seconds`
            await asyncio.to_thread(stack.net.unsplit, "b", "c")
            healed_at = time.monotonic()
            await asyncio.to_thread(stack.until_routed)
            healed = await asyncio.to_thread(outcomes, stack)
            after = await asyncio.gather(*(r.rest() for r in await asyncio.gather(*(_open(c, t) for t in STREAMS))))
            later = await asyncio.to_thread(outcomes, stack)
            return {"reference": reference, "during": done, "after": after, "done_s": done_s,
                    "after_s": time.monotonic() - healed_at, "after_heal": {k: later[k] - healed[k] for k in later}}
        finally:
            await c.close()

    return stack.run_async("a", go)


@pytest.mark.slow  # the real model: ~45 s a case
@pytest.mark.parametrize("seconds", [5, 20, 60])
def test_a_split_between_prefill_and_decode_hosts_loses_nothing(stack: HostStack, seconds: float) -> None:
    before = outcomes(stack)
    try:
        got = run(stack, seconds)
    finally:
        stack.net.heal_all()
    delta = {k: v - before[k] for k, v in outcomes(stack).items()}
    print(f"\nsplit prefill|decode {seconds}s: {len(STREAMS)} requests sent in the cut done in {got['done_s']:.1f}s, "
          f"{len(STREAMS)} after the heal in {got['after_s']:.1f}s; outcomes {delta}")
    for ref, during, after in zip(got["reference"], got["during"], got["after"], strict=True):
        assert during.text == ref.text and after.text == ref.text
        assert during.usage.completion_tokens == after.usage.completion_tokens == MAX_TOKENS
    n = len(STREAMS)
    # before, in and after the cut: each request finished once, all on the decode worker (a split
    # request whose KV cannot reach it is taken over there: its prompt recomputed)
    assert delta["decode-c:finished"] == 3 * n and delta["prefill-b:finished"] == 0
    assert delta["prefill-b:failed"] == delta["prefill-b:aborted"] == delta["decode-c:aborted"] == 0
    # after the heal: the split path again, nothing failed
    after = got["after_heal"]
    assert after["prefill-b:handed_off"] == after["decode-c:finished"] == n and after["decode-c:failed"] == 0
