"""The engine's live requests: one engine request per choice, grouped by the caller's request id.

A request with n > 1 fans out into n engine requests `<id>#<i>` (n == 1 keeps the caller's id);
outputs name the caller's id and the choice index, and aborting the caller's id ends them all.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from moebus.engine.request import Request
from moebus.text.detokenizer import IncrementalDetokenizer
from moebus.text.stop_strings import StopStringMatcher


@dataclass(slots=True)
class Tracked:
    req: Request
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    group: str  # the caller's request id
    index: int = 0  # the choice


def choice_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{k}" for k in range(n)]


class RequestTable:
    """Live engine requests by engine id (a mapping), and each caller's request's live choices."""

    def __init__(self) -> None:
        self._by_id: dict[str, Tracked] = {}
        self._groups: dict[str, list[str]] = {}

    def add(self, choices: list[Tracked]) -> None:
        """The choices of one request (its id must be free: see `taken`)."""
        self._groups[choices[0].group] = [tr.req.request_id for tr in choices]
        for tr in choices:
            self._by_id[tr.req.request_id] = tr

    def taken(self, request_id: str, ids: list[str]) -> bool:
        return request_id in self._groups or any(i in self._by_id for i in ids)

    def pop(self, rid: str) -> Tracked | None:
        """Forget one engine request (None: not live)."""
        tr = self._by_id.pop(rid, None)
        if tr is not None:
            live = self._groups[tr.group]
            live.remove(rid)
            if not live:
                del self._groups[tr.group]
        return tr

    def choices(self, request_id: str) -> list[Tracked]:
        """The live choices of a caller's request, in choice order."""
        return [self._by_id[rid] for rid in self._groups.get(request_id, ())]

    def get(self, rid: str) -> Tracked | None:
        return self._by_id.get(rid)

    def __getitem__(self, rid: str) -> Tracked:
        return self._by_id[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)
