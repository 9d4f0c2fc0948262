"""HTTP probe server for orchestrators: /healthz (liveness), /readyz (readiness), /metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .service import Service

SERVICE_KEY: web.AppKey[Service] = web.AppKey("service")


async def _healthz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    # Liveness ignores a NATS blip (the client reconnects); it fails only when the process is broken.
    ok = svc.healthy
    return web.json_response(svc.health_reply().model_dump(), status=200 if ok else 503)


async def _readyz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    reply = svc.health_reply()
    ok = reply.ready and svc.bus.connected and svc.healthy
    return web.json_response(reply.model_dump(), status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    return web.Response(body=svc.metrics.render(), headers={"Content-Type": svc.metrics.content_type})


def probe_app(service: Service) -> web.Application:
    app = web.Application()
    app[SERVICE_KEY] = service
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


async def start_probe_server(service: Service, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(probe_app(service), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
