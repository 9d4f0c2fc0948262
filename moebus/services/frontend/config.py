from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moebus.shared.service import ServiceConfig


class RequestLimits(BaseModel):
    """Bounds on one request, checked at the edge before anything of it goes on the bus.

    Violations are 400s naming the field (a body over `max_body_bytes`: 413). `max_model_len`
    must match the workers' engine (EngineConfig.max_model_len; `moebus up` copies it over).
    """

    model_config = ConfigDict(extra="forbid")

    max_model_len: int = Field(8192, ge=2)  # prompt + completion tokens
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # the HTTP body (aiohttp client_max_size)
    max_n: int = Field(16, ge=1)  # choices per prompt
    max_prompts: int = Field(64, ge=1)  # /v1/completions: prompts in one request
    max_messages: int = Field(2048, ge=1)  # /v1/chat/completions: messages in one request
    max_images: int = Field(8, ge=0)  # image parts in one chat request
    max_stop_sequences: int = Field(4, ge=0)
    max_stop_chars: int = Field(1024, ge=1)  # each stop string
    max_stop_token_ids: int = Field(128, ge=0)
    max_logprobs: int = Field(20, ge=0)  # chat top_logprobs, completions logprobs
    max_schema_bytes: int = Field(64 * 1024, ge=16)  # response_format's JSON schema, as JSON
    max_schema_depth: int = Field(64, ge=1)  # its nesting (the bus encoder stops at 255)


class FrontendConfig(ServiceConfig):
    host: str = "0.0.0.0"
    port: int = 8000
    models: list[str] = ["smollm2"]  # model names served (what the workers advertise)
    api_keys: list[str] = Field(default_factory=list, validate_default=True)  # empty: no auth; also $MOEBUS_API_KEYS
    max_inflight: int = Field(1024, ge=1)  # concurrent generations; beyond: 503 + Retry-After
    limits: RequestLimits = RequestLimits()
    tokenizer_timeout_s: float = 10.0
    route_timeout_s: float = 15.0
    stream_idle_timeout_s: float = 120.0  # no chunk for this long: give up on the request
    # While no tokenizer or balancer answers (a crashed one is being restarted), requests wait this
    # long for one instead of failing: nobody got them, so asking again is safe.
    restart_wait_s: float = 15.0
    # Chat image parts go to the vision encoder service; off: they are refused with a 400 (no
    # encoder runs, or the model cannot take images).
    accept_images: bool = False
    encoder_timeout_s: float = 10.0  # a request to a killed encoder is asked again after this
    # Moves of one request to another worker (its worker died, drained or failed retryably); the
    # open choices go on from the tokens already sent (generation.py).
    max_migrations: int = Field(3, ge=0)
    # Workers one request may break (they died, or their engine failed, while holding it) before
    # it is failed instead of sent to the next: a poison request cannot walk the fleet.
    max_worker_failures: int = Field(2, ge=1)

    @field_validator("api_keys", mode="after")
    @classmethod
    def _env_keys(cls, keys: list[str]) -> list[str]:
        # Keys from the environment stay out of process listings.
        env = [k.strip() for k in os.environ.get("MOEBUS_API_KEYS", "").split(",") if k.strip()]
        return keys + env
