"""Which holder (worker per tier, or the KV broker's shared tiers) has which prefix blocks, fed by
KVEvents. The broker keeps one (its `query` endpoint answers from it) and so does every balancer
replica (it routes from its own copy without asking anyone); a worker sharing the broker's tiers
keeps one of the broker's own events (it asks for blocks only where they are)."""
from __future__ import annotations

from collections import defaultdict

from moebus.shared.messages import KVEvent, PrefixMatch

Key = tuple[str, str]  # (holder, tier)


class PrefixIndex:
    def __init__(self) -> None:
        self._by_key: dict[Key, set[int]] = defaultdict(set)
        self._by_hash: dict[int, set[Key]] = defaultdict(set)
        self._last_seen: dict[str, float] = {}

    def apply(self, ev: KVEvent, now: float) -> None:
        key = (ev.holder, ev.tier)
        self._last_seen[ev.holder] = now
        if ev.cleared:
            self.remove_holder(ev.holder)
            self._last_seen[ev.holder] = now
        if ev.snapshot:
            self._discard(key, list(self._by_key.get(key, ())))
        self._discard(key, ev.evicted)
        if not ev.stored:
            return
        held = self._by_key[key]
        for h in ev.stored:
            held.add(h)
            self._by_hash[h].add(key)

    def _discard(self, key: Key, hashes: list[int]) -> None:
        held = self._by_key.get(key)
        if held is None:
            return
        for h in hashes:
            held.discard(h)
            keys = self._by_hash.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_hash[h]
        if not held:
            del self._by_key[key]

    def remove_holder(self, holder: str) -> bool:
        keys = [k for k in self._by_key if k[0] == holder]
        for k in keys:
            self._discard(k, list(self._by_key[k]))
        self._last_seen.pop(holder, None)
        return bool(keys)

    def knows_any(self, holders: set[str]) -> bool:
        """Whether any of `holders` has reported its cache (within the expiry)."""
        return any(h in self._last_seen for h in holders)

    def expire(self, now: float, ttl_s: float) -> list[str]:
        """Forget holders silent for ttl_s (workers send a snapshot at least that often)."""
        dead = [h for h, t in self._last_seen.items() if now - t > ttl_s]
        for h in dead:
            self.remove_holder(h)
        return dead

    def longest_prefix(self, hashes: list[int], holders: set[str] | None = None) -> list[PrefixMatch]:
        """Per (holder, tier): how many leading hashes it holds; best first, then by name."""
        counts: dict[Key, int] = {}
        active: set[Key] | None = None
        for i, h in enumerate(hashes):
            have = self._by_hash.get(h, set())
            active = {k for k in have if holders is None or k[0] in holders} if active is None else active & have
            if not active:
                break
            for k in active:
                counts[k] = i + 1
        return [PrefixMatch(holder=k[0], tier=k[1], num_blocks=n)
                for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]

    def holder_sizes(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (holder, _), held in self._by_key.items():
            out[holder] += len(held)
        return dict(out)
