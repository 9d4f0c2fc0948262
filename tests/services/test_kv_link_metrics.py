"""KV transfer bytes and seconds, by direction, in the worker's registry."""
from __future__ import annotations

import torch

from moebus.kv.payload import KVPayload
from moebus.services.worker.config import WorkerConfig
from moebus.services.worker.kv_link import WorkerKVLink
from moebus.shared.messages import KVTransferSpec
from moebus.shared.metrics import Metrics


class _Transport:
    def __init__(self, payload: KVPayload | None = None) -> None:
        self.payload = payload

    async def send(self, payload, address, transfer_id) -> None:
        pass

    async def receive(self, transfer_id, timeout) -> KVPayload:
        return self.payload


async def test_transfers_count_bytes_and_seconds_by_direction() -> None:
    m = Metrics("worker")
    cfg = WorkerConfig(model="toy", subject_prefix="t.moebus.v1")
    link = WorkerKVLink(cfg, None, "w0", None, None, metrics=m)  # type: ignore[arg-type]
    kv = torch.zeros(1, 4, 2, 8)
    payload = KVPayload(layers=[(kv, kv.clone())], block_size=4, num_tokens=4)
    link._senders["nats"] = _Transport()
    link.receiver = _Transport(payload)
    spec = KVTransferSpec(transfer_id="x", address="t.moebus.v1.kvtransfer.push.w1", decode_worker="w1",
                          prefill_worker="w0")
    assert await link.send(payload, spec)
    assert await link.receive("x", 1.0) is payload
    got = {(s.name, s.labels.get("direction")): s.value for fam in m.registry.collect() for s in fam.samples}
    for direction in ("send", "receive"):
        assert got[("moebus_worker_kv_transfer_bytes_total", direction)] == payload.nbytes == 2 * 4 * 2 * 8 * 4
        assert got[("moebus_worker_kv_transfer_seconds_count", direction)] == 1
