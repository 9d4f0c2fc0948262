"""Which encoder gets an image: the same image goes to the same live encoder (rendezvous hashing
over the encoders' heartbeats), so each encoder's cache serves its share of repeated images
instead of every encoder missing on its first sight of each one."""
from __future__ import annotations

import hashlib
import time

from nats.aio.msg import Msg

from moebus.shared.bus import Bus
from moebus.shared.messages import Heartbeat
from moebus.shared.subjects import Subjects

MISSED_BEATS = 3  # an encoder silent this many intervals is not picked (the queue group still serves)


class EncoderPicker:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects
        self._seen: dict[str, tuple[float, float]] = {}  # instance -> (last beat, its interval)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.heartbeat_all("encoder"), Heartbeat, self._on_beat,
                                 concurrent=False, traced=False, endpoint="encoder_heartbeat")

    async def _on_beat(self, beat: Heartbeat, _: Msg) -> None:
        if beat.draining or not beat.ready:
            self._seen.pop(beat.instance_id, None)
        else:
            self._seen[beat.instance_id] = (time.monotonic(), beat.interval_s)

    def live(self) -> list[str]:
        now = time.monotonic()
        return [i for i, (ts, iv) in self._seen.items() if now - ts <= MISSED_BEATS * iv]

    def pick(self, key: str) -> str | None:
        """The live encoder with the highest hash of (instance, key); None when none is known."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()  # the (large) image once, not per encoder
        return max(self.live(), key=lambda i: hashlib.blake2b(i.encode() + digest, digest_size=8).digest(),
                   default=None)

    def forget(self, instance_id: str) -> None:
        self._seen.pop(instance_id, None)
