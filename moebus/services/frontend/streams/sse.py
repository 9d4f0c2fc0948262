"""Server-sent events framing: plain (`data: <json>` ... `data: [DONE]`, OpenAI's chat and
completions streams) and named (`event: <type>` + `data: <json>`, the Responses and Anthropic
Messages streams)."""
from __future__ import annotations

import orjson
from aiohttp import web


class SSE:
    """Server-sent events writer: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, payload: dict) -> None:
        await self.resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def send_all(self, payloads: list[dict]) -> None:
        """Several events in one write: one TCP segment for the client to wait on, not one each."""
        if payloads:
            await self.resp.write(b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads))

    async def close(self) -> web.StreamResponse:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


class NamedSSE(SSE):
    """Server-sent events with names (`event: <type>` + `data: <json>`), as the Responses and
    Anthropic streams send them; no `[DONE]` line."""

    async def send(self, payload: dict) -> None:
        await self.resp.write(b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n")

    async def send_all(self, payloads: list[dict]) -> None:
        """One write per event (these streams have always gone out so)."""
        for p in payloads:
            await self.send(p)

    async def close(self) -> web.StreamResponse:
        await self.resp.write_eof()
        return self.resp
