from __future__ import annotations

from typing import Any

from pydantic import Field

from moebus.shared.service import ServiceConfig


class WorkerConfig(ServiceConfig):
    model: str = "smollm2"  # engine model name or checkpoint dir; "toy" runs the torch-free stand-in
    served_model_name: str | None = None  # the name clients use; default: `model`
    max_queued: int = Field(128, ge=1)  # requests waiting for their first token; beyond: "overloaded"
    drain_grace_s: float = 30.0  # on SIGTERM, how long running requests may take to finish
    engine: dict[str, Any] = {}  # extra EngineConfig (or ToyEngineConfig) fields, e.g. {"max_num_seqs": 8}
