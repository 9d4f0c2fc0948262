"""Run one service in this process until SIGTERM/SIGINT, then shut it down gracefully."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .logs import setup_logging
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
            waits = [asyncio.ensure_future(e.wait()) for e in (stop, service.stop_requested, service.exit_requested)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            log.info("%s stopping: draining", service.instance_id)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(service: Service) -> None:
    """Entry point of `python -m moebus.services.<svc>`: uvloop when available."""
    setup_logging(service.name)
    try:
        import uvloop

        uvloop.run(serve_until_signal(service))
    except ImportError:
        asyncio.run(serve_until_signal(service))
    if service.exit_reason is not None:
        sys.exit(f"{service.instance_id} exited: {service.exit_reason}")
