"""Typed application and request state keys."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from .admission.access import AccessLog, RequestRecord
from .admission.tenants import Tenant
from .config import FrontendConfig

if TYPE_CHECKING:
    from .service import FrontendService

CONFIG: web.AppKey[FrontendConfig] = web.AppKey("config", FrontendConfig)
FRONTEND: web.AppKey[FrontendService] = web.AppKey("frontend")
TENANT: web.RequestKey[Tenant] = web.RequestKey("tenant", Tenant)  # set by the auth middleware
ACCESS: web.AppKey[AccessLog] = web.AppKey("access", AccessLog)
RECORD: web.RequestKey[RequestRecord] = web.RequestKey("record", RequestRecord)  # set by the access middleware
