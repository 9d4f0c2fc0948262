"""Admission per tenant: a request-rate bucket, a budget of tokens in flight, then the fair queue.

A request's tokens are its prompt plus the most it may generate (n x max_tokens), counted when
it is admitted and handed back when it ends, however it ends (admit() is a context manager).
Over the rate or the budget: 429 with Retry-After at once (Rejected); waiting for the frontend's
capacity (fair_queue.py) longer than max_wait_s: 429 too. Metrics are per tenant (docs/tenants.md).
A tenant's rate and budget are the deployment's: with N frontends alive (`frontends`, peers.py)
this one enforces 1/N of each (a bucket of rate/N and burst/N, at least 1; a budget of budget // N).
"""
from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from moebus.shared.metrics import Metrics

from ..config import AdmissionConfig, TenantLimits
from ..errors import APIError
from .fair_queue import FairQueue
from .tenants import Tenant

_CODES = {"rate": "rate_limit_exceeded", "budget": "tokens_in_flight_exceeded", "wait": "queue_timeout",
          "too_large": "tokens_in_flight_exceeded"}


class Rejected(APIError):
    """429 (400 when retrying cannot help); `reason` labels the metric."""

    def __init__(self, reason: str, message: str, retry_after: float | None = 1.0, status: int = 429) -> None:
        super().__init__(status, message, type="rate_limit_error" if status == 429 else "invalid_request_error",
                         code=_CODES[reason], retry_after=retry_after)
        self.reason = reason


class TokenBucket:
    """`rate` requests a second on average, up to `burst` at once; of it, `1/share` here."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._level, self._at = float(burst), now

    def take(self, now: float, share: int = 1) -> float:
        """0: taken; else the seconds until one will be there."""
        rate, burst = self.rate / share, max(1.0, self.burst / share)
        self._level = min(burst, self._level + (now - self._at) * rate)
        self._at = now
        if self._level >= 1:
            self._level -= 1
            return 0.0
        return (1 - self._level) / rate


@dataclass(slots=True)
class _Account:
    limits: TenantLimits
    bucket: TokenBucket | None
    tokens: int = 0  # in flight: admitted, waiting or running
    waiting: int = 0


class Admission:
    def __init__(self, cfg: AdmissionConfig, metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 frontends: Callable[[], int] = lambda: 1) -> None:
        self.cfg, self._clock, self._frontends = cfg, clock, frontends  # frontends: alive now, this one included
        self.queue = FairQueue(cfg.max_running, cfg.max_running_tokens, cfg.fair_share)
        self._accounts: dict[str, _Account] = {}
        self.m_admitted = metrics.counter("tenant_admitted_total", "Generations started, per tenant", ["tenant"])
        self.m_rejected = metrics.counter("tenant_rejected_total", "Requests refused: rate, budget, wait (gave up "
                                          "waiting for capacity) or too_large (over the budget alone)",
                                          ["tenant", "reason"])
        self.m_tokens = metrics.gauge("tenant_tokens_in_flight", "Prompt + max output tokens of a tenant's "
                                      "requests waiting or running", ["tenant"])
        self.m_waiting = metrics.gauge("tenant_waiting_requests", "Requests waiting for capacity", ["tenant"])
        self.m_wait = metrics.histogram("tenant_queue_wait_seconds", "Time from admission to start", ["tenant"])

    def tokens_in_flight(self, tenant: str) -> int:
        acct = self._accounts.get(tenant)
        return acct.tokens if acct else 0

    def check_rate(self, tenant: Tenant) -> None:
        """Take one request from the tenant's bucket, or raise Rejected."""
        acct = self._account(tenant)
        if acct.bucket is None:
            return
        n = self._frontends()
        wait = acct.bucket.take(self._clock(), n)
        if wait:
            self.m_rejected.labels(tenant.name, "rate").inc()
            here = f" ({acct.limits.rate / n:g} here, one of {n} frontends)" if n > 1 else ""
            raise Rejected("rate", f"tenant {tenant.name!r} is over its rate of {acct.limits.rate:g} requests/s{here}",
                           retry_after=wait)

    @asynccontextmanager
    async def admit(self, tenant: Tenant, tokens: int) -> AsyncIterator[None]:
        """Hold `tokens` of the tenant's budget and a place in the capacity while the body runs."""
        acct, name = self._account(tenant), tenant.name
        budget = acct.limits.max_tokens_in_flight
        if budget is not None and tokens > budget:
            self.m_rejected.labels(name, "too_large").inc()
            raise Rejected("too_large", f"the request needs {tokens} tokens (prompt + n x max_tokens); tenant "
                           f"{name!r} may have {budget} in flight: lower max_tokens", None, status=400)
        n = self._frontends()
        # over this frontend's share alone (not the whole budget): a 429, the share grows when frontends go
        if budget is not None and acct.tokens + tokens > (share := budget // n):
            self.m_rejected.labels(name, "budget").inc()
            held = f"{acct.tokens} of its {budget} tokens in flight" if n == 1 else \
                f"{acct.tokens} tokens in flight here, where its share of {budget} is {share} ({n} frontends)"
            raise Rejected("budget", f"tenant {name!r} has {held}; this request needs {tokens} more")
        acct.tokens += tokens
        self.m_tokens.labels(name).set(acct.tokens)
        try:
            await self._start(tenant, acct, tokens)
            try:
                yield
            finally:
                self.queue.release(tokens)
        finally:
            acct.tokens -= tokens
            self.m_tokens.labels(name).set(acct.tokens)

    async def _start(self, tenant: Tenant, acct: _Account, tokens: int) -> None:
        began = self._clock()
        acct.waiting += 1
        self.m_waiting.labels(tenant.name).set(acct.waiting)
        try:
            await self.queue.acquire(tenant.name, tokens, tenant.limits.weight, self.cfg.max_wait_s)
        except TimeoutError:
            self.m_rejected.labels(tenant.name, "wait").inc()
            raise Rejected("wait", f"no capacity for tenant {tenant.name!r} within {self.cfg.max_wait_s:g}s") from None
        finally:
            acct.waiting -= 1
            self.m_waiting.labels(tenant.name).set(acct.waiting)
        self.m_wait.labels(tenant.name).observe(self._clock() - began)
        self.m_admitted.labels(tenant.name).inc()

    def _account(self, tenant: Tenant) -> _Account:
        acct = self._accounts.get(tenant.name)
        if acct is None:
            lim = tenant.limits
            bucket = TokenBucket(lim.rate, lim.burst or max(1, math.ceil(lim.rate)), self._clock()) if lim.rate else None
            acct = self._accounts[tenant.name] = _Account(lim, bucket)
        return acct
