"""Received by the KV broker: prefix-block events, longest-prefix queries, tier get, stats.

Block hashes are the process-stable chained hashes of kv.hashing (63-bit ints); a hash
names its whole token prefix. Block data never rides in these messages: it moves as a chunked
KV transfer (kv.transports) to the address a message names (`Subjects.kvbroker_put` for
puts, `BlockGet.reply_address` for gets). Errors come back as ServiceError headers.
"""
from __future__ import annotations

from typing import Literal

from ..codec import Message

BROKER_HOLDER = "kvbroker"  # holder id of the broker's own CPU/disk tiers in query replies
TierName = Literal["device", "cpu", "disk"]


class KVEvent(Message):
    """A holder's prefix-cache changes (published, no reply). snapshot=True: `stored` is
    everything the holder has in that tier (replaces what the broker knew; heals lost events);
    otherwise a diff."""

    holder: str
    tier: TierName = "device"
    stored: list[int] = []
    evicted: list[int] = []
    snapshot: bool = False
    cleared: bool = False  # the holder dropped everything (restart, cache reset)
    seq: int = 0


class PrefixQuery(Message):
    hashes: list[int]  # a request's chain, first block first
    holders: list[str] = []  # only these (empty: all)


class PrefixMatch(Message):
    holder: str
    tier: TierName
    num_blocks: int  # leading blocks of the query this holder has


class PrefixQueryReply(Message):
    num_hashes: int
    matches: list[PrefixMatch] = []  # best first


class BlockGet(Message):
    """Ask the broker for the leading run of `hashes` its tiers hold; they arrive as one KV
    transfer named `transfer_id` at `reply_address` (a KV transport address)."""

    hashes: list[int]
    reply_address: str
    transfer_id: str


class BlockGetReply(Message):
    transfer_id: str
    num_blocks: int  # 0: nothing is sent


class BrokerStats(Message):
    holders: dict[str, int] = {}  # holder -> blocks indexed
    tiers: dict[str, dict[str, int]] = {}
    puts: int = 0
    gets: int = 0
    queries: int = 0
