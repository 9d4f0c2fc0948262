"""A request that breaks engines, on a toy-model stack: it breaks at most two workers (never a third),
the requests that shared a broken engine are rerun elsewhere (as suspects, each alone: worker
quarantine) and succeed, and every broken engine is rebuilt and serves again. A worker whose
engine cannot come back asks its process to exit."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY, ToyEngine, ToyEngineConfig, ToyTokenizer

from .conftest import toy_stack, wait_for

MARK = "POISON-PILL"
_MARK_IDS = ToyTokenizer().encode(MARK)


class BreakingToyEngine(ToyEngine):
    """A toy engine whose step raises (an engine fault, nobody blamed) while it runs a request whose
    prompt holds MARK: what a request that trips an engine bug does to it."""

    def step(self):
        out = super().step()
        for req in self._running.values():
            if _contains(req.prompt, _MARK_IDS):
                raise RuntimeError("engine broken by a poison request")
        return out


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _factory() -> ToyEngine:
    return BreakingToyEngine(ToyEngineConfig(step_delay_s=0.002))


FAST_RESTART = {"engine_restart_backoff_s": 0.05}


async def test_poison_breaks_at_most_two_workers_and_they_come_back(nats_server) -> None:
    async with toy_stack(nats_server.url, workers=3, engine_factory=_factory, worker=FAST_RESTART) as stack:
        c = stack.client()

        async def normal() -> str:
            r = await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}])
            return r.choices[0].message.content

        async def poison() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as e:
                await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": MARK}])
            return e.value

        results = await asyncio.gather(poison(), *[normal() for _ in range(6)])
        err = results[0]
        assert err.status_code == 500 and err.body["code"] == "request_failed", err.body
        assert "failed on 2 workers" in err.body["message"]
        assert all("toy model" in text for text in results[1:])  # the ones sharing a broken engine: rerun
        broken = [w for w in stack.workers if w._loop.restarts]
        assert len(broken) == 2, [w.counters for w in stack.workers]  # the third never saw it
        started = time.monotonic()
        await wait_for(lambda: all(w.ready for w in stack.workers), timeout=5)
        print(f"broken workers ready again within {time.monotonic() - started:.2f} s of the error")
        await wait_for(lambda: len(stack.balancer.table.candidates("toy", time.monotonic())) == 3, timeout=5)
        assert all(w.healthy and not w.exit_requested.is_set() for w in stack.workers)
        for _ in range(6):  # every worker serves again
            assert "toy model" in await normal()


async def test_engine_gone_for_good_asks_the_process_to_exit(nats_server) -> None:
    async with toy_stack(nats_server.url, workers=1, engine_factory=_factory,
                         worker={"engine_restarts": 0}) as stack:
        c = stack.client()
        with pytest.raises(openai.APIStatusError) as e:
            await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": MARK}])
        assert e.value.status_code in (500, 503)
        w = stack.workers[0]
        await wait_for(lambda: w.exit_requested.is_set(), timeout=5)
        assert not w.ready and not w.healthy and "engine failed for good" in w.exit_reason


async def test_restart_budget_counts_failures_in_a_row(nats_server) -> None:
    """An engine that served long enough before it broke starts a new restart budget, so a
    long-lived worker does not exit after `engine_restarts` unrelated failures spread over days."""
    async with toy_stack(nats_server.url, workers=1, engine_factory=_factory,
                         worker={"engine_restarts": 1, **FAST_RESTART}) as stack:
        c, w = stack.client(), stack.workers[0]
        w._loop.healthy_after_s = 0.0  # every engine counts as having served long enough
        for _ in range(3):  # three failures, one restart allowed in a row: the worker stays
            with pytest.raises(openai.APIStatusError):
                await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": MARK}])
            await wait_for(lambda: w.ready, timeout=5)
        assert w._loop.restarts == 1 and not w.exit_requested.is_set()
        r = await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}])
        assert "toy model" in r.choices[0].message.content


class LateBreakingToyEngine(ToyEngine):
    """Breaks on the third step it runs the poison: requests beside it have streamed from this
    engine by then, so a batch split and rerun on the same worker must go on from those tokens."""

    steps_with_poison = 0

    def step(self):
        out = super().step()
        if any(_contains(r.prompt, _MARK_IDS) for r in self._running.values()):
            self.steps_with_poison += 1
            if self.steps_with_poison >= 3:
                raise RuntimeError("engine broken by a poison request")
        return out


async def test_a_batch_of_suspects_with_a_poison_is_split_on_its_worker() -> None:
    """P and two innocents break worker A; on B they run as one batch of suspects, break it, and
    B splits the batch until P breaks it alone: P fails ("failed on 2 workers", B counts as one),
    the innocents end with the whole reply (resumed twice, nothing repeated or missing), and no
    third engine breaks."""
    from moebus.shared.nats_server import NatsServer

    server = NatsServer().start()
    try:
        async with toy_stack(server.url, workers=2, worker=FAST_RESTART, balancer={"policy": "round_robin"},
                             engine_factory=lambda: LateBreakingToyEngine(ToyEngineConfig(step_delay_s=0.01))) as stack:
            c = stack.client()

            async def ask(text: str) -> str | openai.APIStatusError:
                try:
                    r = await c.chat.completions.create(model="toy", messages=[{"role": "user", "content": text}],
                                                        stream=False)
                    return r.choices[0].message.content
                except openai.APIStatusError as e:
                    return e

            tasks = []
            for text in ["hi 0", "hi 1", "hi 2", "hi 3", MARK, "hi 4"]:  # round robin: P beside 0 and 2
                tasks.append(asyncio.create_task(ask(text)))
                await asyncio.sleep(0.05)  # apart, so round robin places them in this order
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            err = results.pop(4)
            assert isinstance(err, openai.APIStatusError) and "failed on 2 workers" in err.body["message"], err
            assert results == [TOY_REPLY] * 5
            restarts = sorted(w._loop.restarts for w in stack.workers)
            assert restarts[0] == 1 and restarts[1] >= 2, restarts  # A once; B once per split of P's batch
    finally:
        server.stop()
