from __future__ import annotations

import os

from pydantic import Field, field_validator

from moebus.shared.service import ServiceConfig


class FrontendConfig(ServiceConfig):
    host: str = "0.0.0.0"
    port: int = 8000
    models: list[str] = ["smollm2"]  # model names served (what the workers advertise)
    api_keys: list[str] = Field(default_factory=list, validate_default=True)  # empty: no auth; also $MOEBUS_API_KEYS
    max_inflight: int = Field(1024, ge=1)  # concurrent generations; beyond: 503 + Retry-After
    max_n: int = Field(16, ge=1)
    tokenizer_timeout_s: float = 10.0
    route_timeout_s: float = 15.0
    stream_idle_timeout_s: float = 120.0  # no chunk for this long: give up on the request
    max_attempts: int = Field(3, ge=1)  # tries of one request across workers

    @field_validator("api_keys", mode="after")
    @classmethod
    def _env_keys(cls, keys: list[str]) -> list[str]:
        # Keys from the environment stay out of process listings.
        env = [k.strip() for k in os.environ.get("MOEBUS_API_KEYS", "").split(",") if k.strip()]
        return keys + env
