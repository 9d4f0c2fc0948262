"""Continuous batching: each step lets every request's computed tokens catch up with its target.

There are no prefill/decode phases. A request's target is all its known tokens plus drafts to
verify; a step gives each running request min(remaining, budget) tokens (chunked prefill falls
out of the token budget), then admits waiting requests by priority. When blocks run out the
lowest-priority running request is preempted: its blocks are freed and it recomputes later.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (request.num_computed_tokens when scheduled)
    num_tokens: int  # tokens to compute this step
    num_draft: int = 0  # of which trailing drafts to verify
    sample: bool = False  # reaches the end of the known tokens: sample 1 + num_draft positions


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}

    # --- verbs -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.by_id.get(request_id)
        if req is None or req.status.finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free_request(req)
        self.by_id.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            drafts = len(req.draft_token_ids)
            n = min(req.num_tokens + drafts - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.bm.can_allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self.bm.allocate(req, req.num_computed_tokens + n)
            num_draft = max(0, n - (req.num_tokens - req.num_computed_tokens))
            out.scheduled.append(self._entry(req, n, num_draft))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        self.waiting.sort(key=lambda r: (r.priority, r.arrival_time))
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.wait_for is not None and req.wait_for.is_prefill and not req.wait_for.status.finished:
                continue  # let the first of n siblings fill the shared prompt blocks
            cached = self.bm.match_prefix(req) if req.num_computed_tokens == 0 else []
            computed = len(cached) * self.bm.block_size if cached else req.num_computed_tokens
            n = req.num_tokens - computed
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.bm.can_allocate(req, computed + n, cached):
                break
            self.bm.allocate(req, computed + n, cached)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._entry(req, n, 0))
            budget -= n
        return out

    @staticmethod
    def _entry(req: Request, n: int, num_draft: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n, num_draft, start + n >= req.num_tokens)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        out.preempted.append(req)
