"""Run the frontend app: handler cancellation on (a client that goes away cancels its request).

aiohttp's keepalive timer runs from a connection's opening and from the end of each response until
a whole request head has arrived, so `limits.header_timeout_s` as keepalive_timeout closes a
connection that sends its headers too slowly (slow-loris) as well as an idle one. Request lines
and header fields past 8190 bytes, or more than 128 headers, are aiohttp's own 400s.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from opentelemetry.trace import TracerProvider

from .app import create_app
from .config import FrontendConfig

log = logging.getLogger(__name__)


async def start_frontend(cfg: FrontendConfig, tracer_provider: TracerProvider | None = None) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (call .cleanup() to stop) and the bound port."""
    runner = web.AppRunner(create_app(cfg, tracer_provider), handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.drain_timeout_s, keepalive_timeout=cfg.limits.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return runner, port


async def serve_frontend(cfg: FrontendConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner, port = await start_frontend(cfg)
    log.info("frontend listening on %s:%d", cfg.host, port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # stop accepting, let requests finish, then drain the bus
