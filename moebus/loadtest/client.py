"""One streamed request through the `openai` SDK's async client, timed chunk by chunk.

The output length is forced (max_tokens = min_tokens = n, ignore_eos), and usage is asked for in
the stream (stream_options.include_usage) for the token counts and cached prompt tokens.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

REJECTED = (429, 503)


@dataclass(slots=True)
class RequestRecord:
    index: int  # position in the (shaped) trace
    scheduled_s: float  # when the trace says to send it, from the run's start
    sent_s: float = 0.0  # when it was sent
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # every gap between content chunks after the first
    e2e_s: float | None = None
    done_s: float | None = None  # when it finished (or failed), from the run's start
    input_tokens: int = 0  # asked for
    output_tokens: int = 0  # asked for
    prompt_tokens: int | None = None  # reported (usage)
    completion_tokens: int | None = None  # reported (usage), else the number of content chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    status: int | None = None  # HTTP status; None: no response (connection error, cancelled)
    error: str | None = None
    sent_unix: float = 0.0  # sent_s on the wall clock (to line up with server logs and injected faults)
    finish_reason: str | None = None  # the stream's last one; None after a 200: cut short (an error)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_client(base_url: str, api_key: str = "none", timeout_s: float = 600.0) -> openai.AsyncOpenAI:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return openai.AsyncOpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=timeout_s)


async def send(client: openai.AsyncOpenAI, model: str, rec: RequestRecord, *, prompt: str | None = None,
               messages: list[dict] | None = None, t0: float, temperature: float | None = None) -> RequestRecord:
    """Send one request and fill `rec` (never raises for HTTP or transport errors). temperature None
    leaves the server's default (the API's is 1: sampling); 0 asks for greedy decoding."""
    n = rec.output_tokens
    extra = {"min_tokens": n, "ignore_eos": True}
    opts: dict = {"stream_options": {"include_usage": True}}
    if temperature is not None:
        opts["temperature"] = temperature
    start = time.perf_counter()
    rec.sent_s = start - t0
    rec.sent_unix = time.time()
    last = None
    chunks = 0
    try:
        if messages is not None:
            stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                                          stream=True, extra_body=extra, **opts)
        else:
            stream = await client.completions.create(model=model, prompt=prompt or "", max_tokens=n,
                                                     stream=True, extra_body=extra, **opts)
        rec.status = 200
        async for chunk in stream:
            now = time.perf_counter()
            reason = _finish_reason(chunk)
            if reason is not None:
                rec.finish_reason = reason
            if _has_content(chunk):
                chunks += 1
                if last is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
            if chunk.usage is not None:
                _usage(rec, chunk.usage)
        rec.e2e_s = time.perf_counter() - start
        if rec.completion_tokens is None:
            rec.completion_tokens = chunks
        if rec.finish_reason is None:
            # e.g. llama-cpp-python's server (interrupt_requests, its default) ends a stream with a
            # bare [DONE] when the next request arrives: a 200 that is not a finished request.
            rec.error = f"truncated: the stream ended without a finish_reason after {chunks} chunks"
    except openai.APIStatusError as e:
        rec.status, rec.error = e.status_code, _short(e)
    except openai.APIError as e:  # connection errors, timeouts, a broken stream
        rec.error = _short(e)
    finally:
        rec.done_s = time.perf_counter() - t0
    return rec


def _has_content(chunk: Any) -> bool:
    for c in chunk.choices or []:
        text = getattr(c, "text", None)
        if text is None and getattr(c, "delta", None) is not None:
            text = c.delta.content
        if text:
            return True
    return False


def _finish_reason(chunk: Any) -> str | None:
    for c in chunk.choices or []:
        if getattr(c, "finish_reason", None) is not None:
            return c.finish_reason
    return None


def _usage(rec: RequestRecord, usage: Any) -> None:
    rec.prompt_tokens = usage.prompt_tokens
    rec.completion_tokens = usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and getattr(details, "cached_tokens", None) is not None:
        rec.cached_tokens = details.cached_tokens


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]
