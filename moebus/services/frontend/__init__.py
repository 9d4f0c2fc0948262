"""Frontend service: the OpenAI-compatible HTTP API, talking to the other services over NATS.

By concern, higher imports lower only (a layers contract in pyproject.toml): server.py, app.py;
api/ (the endpoints); streams/ (events, the SSE loop, response pieces) and schema/ (request
bodies); keys.py; service.py (the bus side); prompts/, routing/, fleet/, admission/; choices/;
config.py and errors.py. Text processing (tokenizer, chat template, tool-call parsers) is
moebus.text; this process never imports torch.
"""
from .app import create_app
from .config import FrontendConfig
from .server import serve_frontend, start_frontend

__all__ = ["FrontendConfig", "create_app", "serve_frontend", "start_frontend"]
