"""Continuous batching: each step lets every request's computed tokens catch up with its target.

There are no prefill/decode phases. A request's target is all its known tokens plus drafts to
verify; a step gives each running request min(remaining, budget) tokens (chunked prefill falls
out of the token budget), then admits waiting requests by priority. While several requests have
prompt tokens to compute (a burst), the budget is the smaller burst_step_tokens: the burst prefills
over a few steps and the first requests' first tokens go out after part of the work, not all of it.
In a burst a step that already computes prompt tokens starts no prompt it cannot finish: a
partial chunk would delay the first tokens of the prompts it finishes and hasten none (shortest
remaining work first); a prompt that fits no step is still chunked, first in its step.
When blocks run out the lowest-priority running request is preempted: its blocks are freed and it
recomputes later.

Fair share: an owner (one API call: every prompt and choice of it) holds at most `max_owner_share`
of max_num_seqs while another owner waits. Its extra sequences are passed over at admission, and
when the batch is full it gives back running sequences above its share (its latest first: they
recompute later, their prompt blocks usually still cached) so the others start within a step. Alone,
an owner may fill the batch: the cap binds only while someone else waits.

KV from a tier: with a KV connector attached (moebus.kv.connector), a waiting request about to be
admitted with nothing computed is first handed to it, which loads the prompt's blocks a tier
holds into the prefix cache; the ordinary prefix match then finds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from moebus.kv.connector_port import SchedulerKV


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # The step budget (decode rows included) while prompts compete; None: max_num_batched_tokens.
    # A lone prompt keeps the whole max_num_batched_tokens (bigger GEMMs); without chunked prefill
    # whole prompts must fit, so it does not apply. Why 1536: EngineConfig.
    burst_step_tokens: int | None = 1536
    max_owner_share: float = 0.5  # of max_num_seqs, per owner while others wait (see Scheduler)

    def __post_init__(self) -> None:
        if not 0.0 < self.max_owner_share <= 1.0:
            raise ValueError("max_owner_share must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.burst_step_tokens is not None and self.burst_step_tokens < 1:
            raise ValueError("burst_step_tokens must be >= 1 (or None)")


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
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # their own state raised: fail them

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
        self._kv: SchedulerKV | None = None

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

    def attach_kv(self, kv: SchedulerKV) -> None:
        """The KV connector to ask before admitting a request (its tier's blocks for the prompt)."""
        self._kv = kv

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holding_kv(self) -> list[Request]:
        """Requests that hold KV blocks: the running ones, and waiting ones with KV attached."""
        return self.running + [r for r in self.waiting if r.block_ids]

    # --- KV from elsewhere (a prefill engine): reserve blocks, the caller fills them, admit ----
    def reserve_prefilled(self, req: Request, num_tokens: int, cached: list[int] = ()) -> list[int] | None:
        """Blocks for the first num_tokens tokens of a waiting request whose KV comes from
        elsewhere: the `cached` prefix blocks reused, the rest fresh. Returns the fresh block ids
        for the caller to fill; None when they do not fit (nothing changes: it recomputes)."""
        if req.status is not RequestStatus.WAITING or req.block_ids:
            raise ValueError(f"{req.request_id} is not a waiting request without blocks")
        if not self.bm.can_allocate(req, num_tokens, cached):
            return None
        self.bm.allocate(req, num_tokens, cached)
        return req.block_ids[len(cached):]

    def admit_prefilled(self, req: Request, num_tokens: int) -> None:
        """The KV of req's first num_tokens tokens is in its reserved blocks: count them computed,
        publish them to the prefix cache, and run the request now when there is room (otherwise it
        waits with its KV attached and admission schedules just what is left)."""
        req.num_computed_tokens = num_tokens
        self.bm.cache_blocks(req)
        if len(self.running) < self.config.max_num_seqs:
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._reclaim(out)
        reclaimed = len(out.preempted)
        budget, burst = self._step_budget()
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            try:
                n = self._continue(req, budget, out)
            except Exception as e:  # this request's own state raised: it fails alone
                self._drop(req, e, out)
                continue
            if n is None:
                break
            budget -= n
            i += 1
        if len(out.preempted) > reclaimed:
            return out  # memory is tight: admit nothing new this step
        self.waiting.sort(key=lambda r: (r.priority, r.arrival_time))
        share = _Shares(self.running, self.waiting, self._owner_cap())
        prefilling = any(e.num_tokens - e.num_draft > 1 for e in out.scheduled)  # this step computes a prompt
        passed: list[Request] = []  # over their owner's share while others waited: after them
        for queue in (list(self.waiting), passed):
            for req in queue:
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    return out
                if req.wait_for is not None and req.wait_for.is_prefill and not req.wait_for.status.finished:
                    continue  # let the first of n siblings fill the shared prompt blocks
                if share.capped(req.owner):  # (the first pass may admit the others it waits for)
                    if queue is not passed:
                        passed.append(req)
                    continue
                try:
                    n = self._admit(req, budget, out, whole=burst and prefilling)
                except Exception as e:
                    self._drop(req, e, out)
                    continue
                if n is None:
                    return out
                share.admitted(req.owner)
                budget -= n
                prefilling = prefilling or n > 1
        return out

    def _owner_cap(self) -> int:
        return max(1, int(self.config.max_owner_share * self.config.max_num_seqs))

    def _reclaim(self, out: SchedulerOutput) -> None:
        """A full batch with owners waiting under their share: owners above theirs give back their
        latest sequences, one per such waiting owner's sequence (before this step is planned)."""
        cap = self._owner_cap()
        if len(self.running) < self.config.max_num_seqs or cap >= self.config.max_num_seqs or not self.waiting:
            return
        share = _Shares(self.running, self.waiting, cap)
        want = share.starved() - (self.config.max_num_seqs - len(self.running))
        for req in sorted(self.running, key=lambda r: r.arrival_time, reverse=True):
            if want <= 0:
                break
            if share.over(req.owner):
                self._preempt(req, out)
                share.released(req.owner)
                want -= 1

    def _step_budget(self) -> tuple[int, bool]:
        """This step's token budget, and whether prompts compete for it (a burst)."""
        cfg = self.config
        if cfg.burst_step_tokens is None or not cfg.enable_chunked_prefill:
            return cfg.max_num_batched_tokens, False
        prompts = len(self.waiting) + sum(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)
        if prompts > 1:
            return min(cfg.burst_step_tokens, cfg.max_num_batched_tokens), True
        return cfg.max_num_batched_tokens, False

    def _continue(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Schedule a running request's next tokens (0: it has none now); None: it was preempted."""
        drafts = len(req.draft_token_ids)
        n = min(req.num_tokens + drafts - req.num_computed_tokens, budget)
        if n <= 0:
            return 0
        self.bm.trim(req)  # blocks a sliding window has passed go back before this step allocates
        while not self.bm.can_allocate(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                break
        if req.status is not RequestStatus.RUNNING:
            return None
        self.bm.allocate(req, req.num_computed_tokens + n)
        num_draft = max(0, n - (req.num_tokens - req.num_computed_tokens))
        out.scheduled.append(self._entry(req, n, num_draft))
        return n

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, whole: bool = False) -> int | None:
        """Start a waiting request (its prompt's cached prefix first); None: it does not fit, or
        (whole) it would not finish its prompt in this step."""
        if req.num_computed_tokens == 0 and self._kv is not None:
            self._kv.before_admit(req)
        cached = self.bm.match_prefix(req) if req.num_computed_tokens == 0 else []
        computed = len(cached) * self.bm.block_size if cached else req.num_computed_tokens
        n = req.num_tokens - computed
        if n > budget and (whole or not self.config.enable_chunked_prefill):
            return None
        n = min(n, budget)
        if not self.bm.can_allocate(req, computed + n, cached):
            return None
        self.bm.allocate(req, computed + n, cached)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(self._entry(req, n, 0))
        return n

    def _drop(self, req: Request, error: Exception, out: SchedulerOutput) -> None:
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        out.failed.append((req, error))

    def preempt_all(self) -> None:
        """Every running request back to waiting, its blocks freed: it recomputes from its known
        tokens (after a failed step, whose KV writes cannot be trusted)."""
        out = SchedulerOutput()
        for req in list(reversed(self.running)):
            self._preempt(req, out)

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


class _Shares:
    """Running sequences per owner, against the cap that binds while another owner waits."""

    def __init__(self, running: list[Request], waiting: list[Request], cap: int) -> None:
        self.cap = cap
        self.held: dict[str, int] = {}
        for r in running:
            self.held[r.owner] = self.held.get(r.owner, 0) + 1
        self.waiting: dict[str, int] = {}
        for r in waiting:
            self.waiting[r.owner] = self.waiting.get(r.owner, 0) + 1

    def _others_wait(self, owner: str) -> bool:
        return any(n > 0 for o, n in self.waiting.items() if o != owner)

    def capped(self, owner: str) -> bool:
        return self.held.get(owner, 0) >= self.cap and self._others_wait(owner)

    def over(self, owner: str) -> bool:
        return self.held.get(owner, 0) > self.cap

    def starved(self) -> int:
        """Waiting sequences of owners under their share (each could take a slot)."""
        return sum(min(n, self.cap - self.held.get(o, 0)) for o, n in self.waiting.items()
                   if self.held.get(o, 0) < self.cap)

    def admitted(self, owner: str) -> None:
        self.held[owner] = self.held.get(owner, 0) + 1
        self.waiting[owner] -= 1

    def released(self, owner: str) -> None:
        self.held[owner] -= 1
        self.waiting[owner] = self.waiting.get(owner, 0) + 1
