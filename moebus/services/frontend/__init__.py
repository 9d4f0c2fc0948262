"""Frontend service: the OpenAI-compatible HTTP API, talking to the other services over NATS."""
from .app import create_app
from .config import FrontendConfig
from .server import serve_frontend, start_frontend

__all__ = ["FrontendConfig", "create_app", "serve_frontend", "start_frontend"]
