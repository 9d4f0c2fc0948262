"""python -m moebus.services.kvbroker --nats-url nats://host:4222 [--disk-dir DIR] ..."""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal

from .config import KVBrokerConfig
from .service import KVBrokerService

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 4GiB)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_args(argv: list[str] | None = None) -> KVBrokerConfig:
    d = KVBrokerConfig()
    p = argparse.ArgumentParser(prog="python -m moebus.services.kvbroker")
    p.add_argument("--nats-url", default=d.nats_url)
    p.add_argument("--prefix", default=d.prefix, help="subject prefix")
    p.add_argument("--cpu-bytes", type=parse_bytes, default=d.cpu_bytes)
    p.add_argument("--disk-dir", default=d.disk_dir, help="directory of the disk tier (default: none)")
    p.add_argument("--disk-bytes", type=parse_bytes, default=d.disk_bytes)
    p.add_argument("--disk-fsync", action="store_true")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=d.chunk_bytes)
    p.add_argument("--holder-ttl-s", type=float, default=d.holder_ttl_s)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return KVBrokerConfig(a.nats_url, a.prefix, a.cpu_bytes, a.disk_dir, a.disk_bytes, a.disk_fsync,
                          a.chunk_bytes, a.holder_ttl_s)


async def serve(cfg: KVBrokerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with KVBrokerService(cfg):
        print("kvbroker ready", flush=True)  # launchers and tests wait for this line
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
