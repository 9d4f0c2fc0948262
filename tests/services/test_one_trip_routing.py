"""One trip: the frontend hashes a prompt once, in the space its workers named, and the hashes travel
with the request; the balancer routes from its own index (no request while it holds one)."""
from __future__ import annotations

import ast
import inspect

from moebus.kv.hashing import hash_space, stable_block_hashes
from moebus.services.balancer import service as balancer_service
from moebus.services.frontend.config import FrontendConfig
from moebus.services.frontend.fleet.fleet import FleetView
from moebus.services.frontend.fleet.readiness import WorkerWatch
from moebus.services.frontend.routing.router import StreamRouter
from moebus.shared.messages import Heartbeat, KVInfo, SamplingOptions
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects


def beat(worker: str, model: str, kv: KVInfo | None) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=worker, ts=0, interval_s=1.0, ready=True, model=model, kv=kv)


def test_the_frontend_hashes_the_prompt_in_its_workers_space() -> None:
    fleet = FleetView(clock=lambda: 0.0)
    fleet.observe(beat("w0", "toy", None))
    fleet.observe(beat("w1", "m", KVInfo(namespace="ns", block_size=4)))
    watch = WorkerWatch(fleet)
    router = StreamRouter(None, Subjects(), "fe", FrontendConfig(), Metrics("frontend"))  # type: ignore[arg-type]
    prompt = list(range(10))
    req = router.new("r1", "m", prompt, SamplingOptions(), kv=watch.kv_space("m")).req
    assert req.block_hashes == stable_block_hashes(prompt, 4, "ns") and len(req.block_hashes) == 2
    assert req.block_hash_space == hash_space("ns", 4)
    assert req.block_hashes_in(4, "ns") is req.block_hashes  # the worker and balancer reuse them
    toy = router.new("r2", "toy", prompt, SamplingOptions(), kv=watch.kv_space("toy")).req
    assert toy.block_hashes == [] and toy.block_hash_space == ""


def test_routing_asks_nobody() -> None:
    """While a route holds a request, the balancer's only bus request is the one to the worker."""
    tree = ast.parse(inspect.getsource(balancer_service))
    requests = [ast.unparse(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr == "request"]
    assert requests == ["self.subjects.worker_generate(worker)"]
