from __future__ import annotations

from pydantic import Field

from moebus.shared.service import ServiceConfig


class TokenizerConfig(ServiceConfig):
    model: str = "smollm2"  # engine model name or checkpoint dir; "toy" for the torch-free stand-in
    served_model_name: str | None = None  # the name clients use; default: `model`
    chat_template: str | None = Field(None, description="a jinja chat template file that replaces the model's")
