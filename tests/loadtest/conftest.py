"""The toy-model stack of the service tests (one nats-server per module)."""
from __future__ import annotations

from services.conftest import nats_server, toy_stack  # noqa: F401  (fixture and helper)
