"""aiohttp app factory: routes, JSON error + per-client + auth + tracing middlewares, the bus service as cleanup_ctx."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import TracerProvider

from moebus import __version__
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.logs import request_scope
from moebus.shared.tracing import TRACE_ID_HEADER, trace_id_of

from .admission.access import REQUEST_ID_HEADER, AccessLog
from .admission.tenants import bearer
from .api.chat import chat_completions
from .api.completions import completions
from .api.messages import count_tokens, messages
from .api.openapi import openapi_document
from .api.responses import responses
from .api.tokens import detokenize, tokenize
from .config import FrontendConfig
from .errors import APIError
from .keys import ACCESS, CONFIG, FRONTEND, RECORD, TENANT
from .routing.spans import http_span, http_status
from .service import FrontendService

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PUBLIC = ("/health", "/ready", "/health/ready", "/ping", "/version", "/metrics", "/openapi.json")
_GENERATE = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's id (echoed in X-Request-Id), the scope of its log lines, its access line."""
    rec = request[RECORD] = request.app[ACCESS].begin(request)
    status = 500
    with request_scope(rec.request_id):
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:  # the client went away while the handler ran
            status = 499
            raise
        finally:
            AccessLog.write(rec, status)


async def _request_id_header(request: web.Request, resp: web.StreamResponse) -> None:
    if (rec := request.get(RECORD)) is not None:
        resp.headers[REQUEST_ID_HEADER] = rec.request_id
        if rec.trace_id:
            resp.headers[TRACE_ID_HEADER] = rec.trace_id


def _failed(request: web.Request, err: APIError) -> web.Response:
    """The error's response; its reason goes into the access line."""
    if (rec := request.get(RECORD)) is not None:
        rec.error = f"{err.code or err.type}: {err.message}"[:500]
    return err.response()


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    fe = request.app.get(FRONTEND)
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    started, status = time.monotonic(), 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        return _failed(request, e)
    except ServiceError as e:
        err = APIError.from_service_error(e)
        status = err.status
        return _failed(request, err)
    except web.HTTPException as e:  # aiohttp's own 404/405/413...
        status = e.status
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return _failed(request, APIError(e.status, e.reason if e.status != 404 else f"Unknown route {request.path}",
                                         type=kind, code=code))
    except (asyncio.CancelledError, ConnectionResetError) as e:  # the client went away: nginx's 499, not a 500
        status = 499
        if (rec := request.get(RECORD)) is not None:
            rec.error = "client disconnected"
        if isinstance(e, asyncio.CancelledError):  # handler cancellation
            raise
        return web.Response(status=499)  # a write found the connection closed; aiohttp drops this one too
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return _failed(request, APIError(500, "internal server error", type="server_error", code="internal"))
    finally:
        if fe is not None:
            fe.m_http.labels(route, str(status)).inc()
            fe.m_latency.labels(route).observe(time.monotonic() - started)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The bearer key's tenant (admission/tenants.py; with no keys configured, `default`), charged one
    request of its rate: 401 for an unknown key, 429 over the rate."""
    if request.path in _PUBLIC:
        return await handler(request)
    fe = request.app[FRONTEND]
    # Anthropic's clients send the key as x-api-key
    key = bearer(request.headers.get("Authorization", "")) or request.headers.get("x-api-key", "")
    tenant = fe.keyring.tenant(key)
    if tenant is None:
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
    fe.admission.check_rate(tenant)
    request[TENANT] = tenant
    return await handler(request)


def per_client_middleware(most: int) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """At most `most` generation requests open at once from one client address (0: no limit),
    counted from the headers to the stream's end: 429 + Retry-After beyond."""
    open_: dict[str, int] = {}

    @web.middleware
    async def per_client(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not most or request.path not in _GENERATE:
            return await handler(request)
        client = request.remote or ""
        if open_.get(client, 0) >= most:
            raise APIError(429, f"more than {most} requests at once from one client", type="rate_limit_error",
                           code="too_many_concurrent_requests", retry_after=1)
        open_[client] = open_.get(client, 0) + 1
        try:
            return await handler(request)
        finally:
            if (left := open_.pop(client) - 1) > 0:
                open_[client] = left

    return per_client


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    fe = request.app.get(FRONTEND)
    if fe is None:
        return await handler(request)
    # Continue the client's trace if it sent a traceparent; every bus hop below joins this span.
    rec = request.get(RECORD)
    with http_span(fe.tracing, request, rec.request_id if rec else None) as span:
        if rec is not None:
            rec.trace_id = trace_id_of(span)  # X-Trace-Id (_request_id_header), the access line
        resp = await handler(request)
        http_status(span, resp.status)
        return resp


def _model_card(name: str, cfg: FrontendConfig) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "moebus", "root": name,
            "max_model_len": cfg.limits.max_model_len}


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [_model_card(m, cfg) for m in cfg.models]})


async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name not in request.app[CONFIG].models:
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return web.json_response(_model_card(name, request.app[CONFIG]))


async def ready(request: web.Request) -> web.Response:
    """Readiness (the k8s readinessProbe, deploy/frontend.yaml): 200 once every served model has a ready
    (warmed-up) worker; else 503 with an OpenAI-style `error` saying what is missing, beside the details."""
    fe = request.app[FRONTEND]
    missing = fe.workers.missing(fe.cfg.models)
    body = {"status": "ready", "nats_connected": fe.bus.connected, "draining": fe.draining,
            "models_without_workers": missing,
            "workers": fe.workers.ready_workers()}
    reason = ("not connected to the bus" if not fe.bus.connected else "draining" if fe.draining
              else f"no ready worker serves {', '.join(map(repr, missing))}" if missing else None)
    if reason is None:
        return web.json_response(body)
    err = APIError(503, reason, type="service_unavailable", code=ErrorCode.UNAVAILABLE.value)
    return web.json_response({**err.body(), **body, "status": "not_ready"}, status=503, headers={"Retry-After": "1"})


async def ping(request: web.Request) -> web.Response:
    """Liveness, SageMaker-style (vLLM's /ping): what /health says, without a body."""
    fe = request.app[FRONTEND]
    return web.Response(status=200 if fe.bus.connected and not fe.draining else 503)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    ok = fe.bus.connected and not fe.draining
    return web.json_response({"status": "ok" if ok else "unavailable", "instance_id": fe.instance_id,
                              "nats_connected": fe.bus.connected, "inflight": len(fe.router)},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    return web.Response(body=fe.metrics.render(), headers={"Content-Type": fe.metrics.content_type})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(limits=request.app[CONFIG].limits))


def create_app(cfg: FrontendConfig, tracer_provider: TracerProvider | None = None) -> web.Application:
    app = web.Application(middlewares=[access_middleware, tracing_middleware, errors_middleware,
                                       per_client_middleware(cfg.max_concurrent_per_client), auth_middleware],
                          client_max_size=cfg.limits.max_body_bytes)
    app[CONFIG] = cfg
    app[ACCESS] = AccessLog()
    app.on_response_prepare.append(_request_id_header)

    async def bus_ctx(app: web.Application) -> AsyncIterator[None]:
        async with FrontendService(cfg, tracer_provider=tracer_provider, access=app[ACCESS]) as svc:
            app[FRONTEND] = svc
            yield

    app.cleanup_ctx.append(bus_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health/ready", ready)
    app.router.add_route("*", "/ping", ping)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
