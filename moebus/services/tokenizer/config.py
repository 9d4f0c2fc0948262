from __future__ import annotations

from moebus.shared.service import ServiceConfig


class TokenizerConfig(ServiceConfig):
    model: str = "smollm2"  # engine model name or checkpoint dir; "toy" for the torch-free stand-in
    served_model_name: str | None = None  # the name clients use; default: `model`
