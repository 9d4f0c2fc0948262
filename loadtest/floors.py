"""What no server can go under on this box, for bench_ttft_overhead.py: a bare aiohttp SSE server
(the client + HTTP floor of a first token) and raw nats-py request/reply between two processes
(the floor of the stack's bus hops). A script beside the benchmarks, not moebus.loadtest: the
load tester is an HTTP client and imports no NATS.

    python loadtest/floors.py sse PORT    # serve the bare SSE answer
    python loadtest/floors.py echo URL    # answer `ping` requests on that NATS
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time


def serve_sse(port: int) -> None:
    """Any chat request: a role chunk, max_tokens deltas, usage and [DONE] at once; the headers,
    the role chunk and the first token in one write, as the stack sends them."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        base = {"id": "chatcmpl-floor", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        n = body.get("max_tokens") or 1
        events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{**base, "choices": [{"index": 0, "delta": {"content": "x"},
                                         "finish_reason": "length" if i == n - 1 else None}]} for i in range(n)]
        events.append({**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                                        "total_tokens": n + 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events[:2]))
        for ev in events[2:]:
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def serve_echo(url: str) -> None:
    import nats

    async def serve() -> None:
        nc = await nats.connect(url)

        async def echo(msg) -> None:  # noqa: ANN001
            await nc.publish(msg.reply, msg.data)

        await nc.subscribe("ping", cb=echo)
        await asyncio.Event().wait()

    asyncio.run(serve())


def nats_round_trips(n: int, gap_s: float = 0.05) -> list[float]:
    """ms of n request/reply round trips (512 bytes) to an echo process through a fresh
    nats-server, idle `gap_s` between them as between a request's hops."""
    import nats

    from moebus.shared.nats_server import NatsServer

    async def ping(url: str) -> list[float]:
        nc, xs = await nats.connect(url), []
        for _ in range(n + 5):
            t = time.perf_counter()
            await nc.request("ping", b"x" * 512, timeout=5)
            xs.append(1000 * (time.perf_counter() - t))
            await asyncio.sleep(gap_s)
        await nc.close()
        return xs[5:]  # the first ones warm up

    with NatsServer() as server:
        echo = subprocess.Popen([sys.executable, __file__, "echo", server.url], start_new_session=True)
        try:
            time.sleep(1.0)  # subscribed by then (a no-responders error otherwise)
            return asyncio.run(ping(server.url))
        finally:
            echo.send_signal(signal.SIGTERM)
            echo.wait(10)


def wait_listening(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


if __name__ == "__main__":
    if sys.argv[1] == "sse":
        serve_sse(int(sys.argv[2]))
    else:
        serve_echo(sys.argv[2])
