"""KV broker messages survive encode -> decode; its subjects live in the one Subjects builder."""
from __future__ import annotations

import pytest

from moebus.shared.codec import Message
from moebus.shared.messages import (
    BROKER_HOLDER,
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
)
from moebus.shared.subjects import Subjects

EXAMPLES: list[Message] = [
    KVEvent(holder="worker-0", tier="cpu", stored=[1, (1 << 63) - 1], evicted=[3], snapshot=True, cleared=True, seq=9),
    PrefixQuery(hashes=[5, 6], holders=["worker-0", BROKER_HOLDER]),
    PrefixQueryReply(num_hashes=2, matches=[PrefixMatch(holder=BROKER_HOLDER, tier="disk", num_blocks=2)]),
    BlockGet(hashes=[5, 6], reply_address="_INBOX.abc", transfer_id="get-w-1"),
    BlockGetReply(transfer_id="get-w-1", num_blocks=0),
    BrokerStats(holders={"worker-0": 4}, tiers={"cpu": {"blocks": 4}}, puts=1, gets=2, queries=3),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    assert type(msg).decode(msg.encode()) == msg


def test_tier_names_are_checked() -> None:
    with pytest.raises(ValueError):
        KVEvent.decode(b'{"holder": "w", "tier": "tape"}')


def test_kvbroker_subjects() -> None:
    s = Subjects("p.v1")
    assert [s.kvbroker_events, s.kvbroker_query, s.kvbroker_get, s.kvbroker_put, s.kvbroker_stats] == [
        "p.v1.kvbroker.events", "p.v1.kvbroker.query", "p.v1.kvbroker.get", "p.v1.kvbroker.put", "p.v1.kvbroker.stats"]
    assert s.kvtransfer_push("decode-0") == "p.v1.kvtransfer.push.decode-0"
    assert s.kvbroker_stats != s.stats("kvbroker", "kvbroker-0")  # the broker's stats vs the Service's
    with pytest.raises(ValueError):
        s.kvtransfer_push("a.b")
