"""What one generation may ask for, and the check every service that takes one runs on it.

The frontend checks these bounds on the HTTP request (its RequestLimits adds the HTTP ones: body
size, timeouts, JSON depth); the balancer's `route` and the worker's `generate` check them again
on the GenerateRequest, so a request put on the bus past the frontend is refused too (BAD_REQUEST
naming the field), never run. `moebus up` gives all three the same values.

The trust boundary: the bus knows processes, not clients. Each process has its own NATS user
(bus_auth.py) and only the frontend role may publish `balancer.route`; API keys and tenants exist
at the HTTP edge alone. Whoever holds the frontend role's credentials is trusted as a frontend:
it may generate for any tenant, with any priority, without a key. These checks bound what such a
request may cost (its size), not who sent it; keep those credentials as secret as the API keys.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .errors import ErrorCode, ServiceError
from .messages import GenerateRequest


class GenerationLimits(BaseModel):
    """The bounds of one GenerateRequest (the frontend's RequestLimits adds the HTTP ones)."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int = Field(8192, ge=2)  # prompt + completion tokens (the engines' EngineConfig.max_model_len)
    max_n: int = Field(16, ge=1)  # choices per prompt
    max_stop_sequences: int = Field(4, ge=0)
    max_stop_chars: int = Field(1024, ge=1)  # each stop string
    max_stop_token_ids: int = Field(128, ge=0)
    max_logprobs: int = Field(20, ge=0)  # chat top_logprobs, completions logprobs
    max_images: int = Field(8, ge=0)  # image parts in one chat request

    def generation_limits(self) -> GenerationLimits:
        """These bounds alone (of a subclass with more: the frontend's)."""
        return GenerationLimits(**self.model_dump(include=set(GenerationLimits.model_fields)))

    def check(self, req: GenerateRequest) -> None:
        """ServiceError(BAD_REQUEST), its param the offending field of `req`, when a bound is passed."""
        p, prompt, most = req.params, len(req.prompt_token_ids), self.max_model_len
        if not 1 <= p.n <= self.max_n:
            _refuse("params.n", f"n is {p.n}; it must be 1..{self.max_n}")
        if not prompt:
            _refuse("prompt_token_ids", "the prompt is empty")
        if prompt >= most:
            _refuse("prompt_token_ids", f"the prompt has {prompt} tokens; this model's context is {most} "
                    f"(at most {most - 1} leave room for the completion)")
        if p.max_tokens is not None and not 0 < p.max_tokens <= most - prompt:
            _refuse("params.max_tokens", f"max_tokens is {p.max_tokens}; with a prompt of {prompt} tokens it must "
                    f"be 1..{most - prompt} (context {most})")
        if not 0 <= p.min_tokens <= most:
            _refuse("params.min_tokens", f"min_tokens is {p.min_tokens}; it must be 0..{most}")
        if len(p.stop) > self.max_stop_sequences or any(len(s) > self.max_stop_chars for s in p.stop):
            _refuse("params.stop", f"at most {self.max_stop_sequences} stop sequences of at most "
                    f"{self.max_stop_chars} characters each")
        if len(p.stop_token_ids) > self.max_stop_token_ids:
            _refuse("params.stop_token_ids", f"at most {self.max_stop_token_ids} stop token ids")
        if p.logprobs is not None and not 0 <= p.logprobs <= self.max_logprobs:
            _refuse("params.logprobs", f"logprobs is {p.logprobs}; it must be 0..{self.max_logprobs}")
        if len(req.images) > self.max_images:
            _refuse("images", f"{len(req.images)} images; at most {self.max_images}")
        for c in req.resume:  # a migrated request goes on from these: within its choices and its context
            if not 0 <= c.index < p.n or prompt + len(c.token_ids) > most:
                _refuse("resume", f"resumed choice {c.index} is outside n={p.n} or the context of {most} tokens")


def _refuse(param: str, message: str) -> None:
    raise ServiceError(ErrorCode.BAD_REQUEST, message, param=param)
