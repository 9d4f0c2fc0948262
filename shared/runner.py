"""Run one service in this process until SIGTERM/SIGINT, then shut it down gracefully."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .service import Service

log = logging.getLogger(__name__)


async def serve_until_signal(service: Service, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with service:
            log.info("%s up (instance %s)", service.name, service.instance_id)
            await stop.wait()
            log.info("%s stopping: draining", service.instance_id)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(service: Service) -> None:
    """Entry point of `python -m moebus.services.<svc>`: uvloop when available."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {service.name} %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.run(serve_until_signal(service))
    except ImportError:
        asyncio.run(serve_until_signal(service))
