"""A tenant's limits split between the frontends alive (fleet/peers.py, admission/admission.py), without a bus:
two Admissions that each count 2 frontends admit the tenant's budget and rate once in total."""
from __future__ import annotations

import pytest

from moebus.services.frontend.admission.admission import Admission, Rejected, TokenBucket
from moebus.services.frontend.admission.tenants import Tenant
from moebus.services.frontend.config import AdmissionConfig, TenantLimits
from moebus.services.frontend.fleet.peers import FrontendPeers
from moebus.shared.messages import Heartbeat
from moebus.shared.metrics import Metrics


def _beat(instance: str, interval: float = 1.0, draining: bool = False) -> Heartbeat:
    return Heartbeat(service="frontend", instance_id=instance, ts=0.0, interval_s=interval, draining=draining)


def test_peers_count_the_frontends_heard_within_three_beats() -> None:
    now, m = [0.0], Metrics("frontend")
    peers = FrontendPeers("frontend-0", m, clock=lambda: now[0])
    assert peers.count() == 1
    peers.observe(_beat("frontend-0"))  # its own beat is not a peer
    peers.observe(_beat("frontend-1"))
    peers.observe(_beat("frontend-2", draining=True))  # still holds its requests: still counts
    assert peers.count() == 3 and m.registry.get_sample_value("moebus_frontend_frontends_alive") == 3
    now[0] = 2.9
    peers.observe(_beat("frontend-1"))
    now[0] = 3.5  # frontend-2 silent for 3.5 intervals: gone
    assert peers.count() == 2
    now[0] = 10.0
    assert peers.count() == 1


def test_bucket_share() -> None:
    b = TokenBucket(rate=4.0, burst=4, now=0.0)
    assert [b.take(0.0, share=2) for _ in range(2)] == [0, 0]  # burst 4/2
    assert b.take(0.0, share=2) == pytest.approx(0.5)  # rate 4/2
    b = TokenBucket(rate=1.0, burst=1, now=0.0)
    assert b.take(0.0, share=3) == 0  # a share of the burst is never below one request


async def test_two_frontends_admit_the_budget_once() -> None:
    """Each of 2 admissions takes budget // 2: the tenant's total in flight stays within its budget."""
    acme = Tenant("acme", TenantLimits(max_tokens_in_flight=100))
    adms = [Admission(AdmissionConfig(), Metrics("frontend"), frontends=lambda: 2) for _ in range(2)]
    held = []
    for adm in adms:
        for _ in range(3):
            try:
                cm = adm.admit(acme, 20)
                await cm.__aenter__()
                held.append(cm)
            except Rejected as e:
                assert e.status == 429 and e.reason == "budget" and "2 frontends" in str(e.message)
    assert len(held) == 4 and sum(a.tokens_in_flight("acme") for a in adms) == 80  # 2 x (50 // 20)
    with pytest.raises(Rejected) as e:  # fits the budget, not this frontend's share: may fit later
        async with adms[0].admit(acme, 60):
            pass
    assert e.value.status == 429
    with pytest.raises(Rejected) as e:  # never fits
        async with adms[0].admit(acme, 101):
            pass
    assert e.value.status == 400
    for cm in held:
        await cm.__aexit__(None, None, None)
    assert sum(a.tokens_in_flight("acme") for a in adms) == 0


def test_two_frontends_take_the_rate_once() -> None:
    now = [0.0]
    slow = Tenant("slow", TenantLimits(rate=2.0, burst=4))
    adms = [Admission(AdmissionConfig(), Metrics("frontend"), clock=lambda: now[0], frontends=lambda: 2)
            for _ in range(2)]
    admitted = 0
    for step in range(101):  # 10 s, each frontend asked 10 times a second
        now[0] = step * 0.1
        for adm in adms:
            try:
                adm.check_rate(slow)
                admitted += 1
            except Rejected as e:
                assert "2 frontends" in str(e.message)
    assert admitted == 4 + 2 * 10  # the burst, then the rate: as one frontend alone would allow
