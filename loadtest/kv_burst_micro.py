"""Issue #23 item 2's failure mode in miniature, without the model: 10 SmolLM2-sized KV transfers
(~17 MB each) at once to one receiver whose event loop blocks 0.5 s per arrived payload (a busy
decode worker), through a nats-server with its default MaxPending (64 MiB), each side with the
transport's default config. Prints what arrived, what failed and nats-server's slow-consumer
disconnects. From the repository root (PYTHONPATH picks the tree, old or new transport):

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/kv_burst_micro.py 10
"""
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, ".")
import nats  # noqa: E402

from moebus.kv.transports.nats import NatsKVTransport  # noqa: E402
from moebus.shared.nats_server import NatsServer  # noqa: E402
from tests.kv.test_kv_transport import make_payload  # noqa: E402

RX = "moebus.v1.kvtransfer.push.decode-0"

def main(n=10):
    log = Path(tempfile.mkdtemp()) / "nats.log"
    with NatsServer(jetstream=False, log_file=str(log)) as server:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        got = {}
        async def start_rx():
            nc = await nats.connect(server.url)
            async def on_payload(tid, p):
                got[tid] = p
                time.sleep(0.5)
            return await NatsKVTransport(nc, RX, on_payload=on_payload).start()
        asyncio.run_coroutine_threadsafe(start_rx(), loop).result(10)
        async def send_all():
            ncs = [await nats.connect(server.url) for _ in range(2)]
            ps = [make_payload(num_blocks=28, layers=30, seed=i) for i in range(n)]
            t0 = time.perf_counter()
            res = await asyncio.gather(*(NatsKVTransport(ncs[i % 2], None).send(p, RX, f"t{i}") for i, p in enumerate(ps)),
                                       return_exceptions=True)
            return res, time.perf_counter() - t0, sum(p.nbytes for p in ps)
        res, dt, total = asyncio.run(send_all())
        errs = [r for r in res if isinstance(r, Exception)]
        time.sleep(1)
        sc = log.read_text().count("Slow Consumer Detected")
        print(f"{n} transfers, {total / 1e6:.0f} MB: {len(got)} delivered, {len(errs)} failed "
              f"({type(errs[0]).__name__ if errs else '-'}: {str(errs[0])[:80] if errs else ''}), "
              f"slow-consumer disconnects {sc}, {dt:.1f} s")

main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
