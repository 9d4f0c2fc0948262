"""A worker's heartbeat after a finished request leaves before that request's last chunk: the
balancers see the freed load before the client can send its next request (a follow-up routed on the
stale load went off its cached prefix: test_kv_stack's routing test failed in CI so)."""
from __future__ import annotations

import nats

from moebus.shared.messages import Heartbeat, TokenChunks
from moebus.shared.subjects import Subjects

from .conftest import toy_stack, wait_for


async def test_the_finish_beat_precedes_the_last_chunk(nats_server) -> None:
    # Periodic beats far apart, so any beat seen next to the last chunk is the finish beat.
    async with toy_stack(nats_server.url, worker={"heartbeat_interval_s": 30.0}) as stack:
        s = Subjects(stack.prefix)
        seen: list[str] = []
        watcher = await nats.connect(stack.nats_url)  # one connection: the worker's publish order

        async def on_beat(msg) -> None:
            if Heartbeat.decode(msg.data).load.num_running == 0:
                seen.append("idle beat")

        async def on_chunks(msg) -> None:
            seen.extend("last chunk" for c in TokenChunks.decode(msg.data).chunks if c.finished)
        try:
            await watcher.subscribe(s.heartbeat("worker", "worker-0"), cb=on_beat)
            await watcher.subscribe(s.frontend_chunks("*"), cb=on_chunks)
            await watcher.flush()
            for i in range(3):
                r = await stack.client().completions.create(model="toy", prompt=f"hi {i}", max_tokens=4)
                assert r.choices[0].finish_reason == "length"
            await wait_for(lambda: len(seen) >= 6)  # the watcher's connection may lag the client's reply
        finally:
            await watcher.close()
        assert seen == ["idle beat", "last chunk"] * 3, seen
