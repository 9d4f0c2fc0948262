"""Schemathesis against the toy stack's own /openapi.json (#20 item 5): no 5xx, every 4xx an
OpenAI-style JSON error, no request lost; each body answered 200 sent again with a lone
surrogate in its deepest string (a 400 naming it); faults from clients injected meanwhile (streams cut
after their first chunk, connections trickling their headers); afterwards the stack still
serves and every KV block is free.

CI runs a bounded number of examples per operation and mode; the larger run is `slow`:
    .venv/bin/python -m pytest tests/services/frontend/test_fuzz_api.py -m slow -s
It prints the figures (README, "Bad input and limits").
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

pytest.importorskip("schemathesis")
import hypothesis  # noqa: E402  (schemathesis brings it)
import requests  # noqa: E402
import schemathesis  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from ..conftest import ToyStack, toy_stack  # noqa: E402

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# A short context keeps what a generated request may ask for small; header_timeout_s ends the
# trickling connections (its real default is 60 s).
FRONTEND = {"api_keys": [KEY], "limits": {"max_model_len": 512, "header_timeout_s": 2.0}}
ENGINE = {"step_delay_s": 0.0, "max_model_len": 512}


@dataclass
class Figures:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # no HTTP answer at all
    failures: list[str] = field(default_factory=list)
    # Schema-violating bodies answered 200: pydantic's lax mode takes `false` for a number, 0/1 for a
    # bool, "1" for an integer, as the validator always has. Counted, not failed.
    lenient: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    server_5xx: list[str] = field(default_factory=list)  # the frontend's own count, by route

    def summary(self) -> str:
        bad = sum(n for s, n in self.statuses.items() if 400 <= s < 500)
        fivexx = sum(n for s, n in self.statuses.items() if s >= 500)
        return (f"{self.requests} requests ({bad} refused with a 4xx), {fivexx} 5xx, {len(self.lost)} lost, "
                f"faults injected {dict(self.faults)}; statuses {dict(sorted(self.statuses.items()))}; "
                f"schema violations accepted (lax coercion) {dict(self.lenient.most_common(8))}")


def _schema(doc: dict) -> Any:
    """Our document with `model` pinned to the served one, so most cases get past the model check
    (negative cases still mutate it)."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": ["toy"]}
    return schemathesis.openapi.from_dict(doc)


def _check(case: Any, resp: requests.Response, figures: Figures) -> None:
    status = resp.status_code
    figures.statuses[status] += 1
    where = f"{case.operation.label} -> {status}: {case.as_curl_command(headers=AUTH)[:400]}"
    try:
        case.validate_response(resp, checks=CHECKS, headers=AUTH)
    except (Exception, BaseExceptionGroup) as e:  # schemathesis's failures (a FailureGroup holds several)
        figures.failures.append(f"{where}\n  {str(e)[:600]}")
    try:
        case.validate_response(resp, checks=[negative_data_rejection], headers=AUTH)
    except (Exception, BaseExceptionGroup) as e:
        for f in getattr(e, "exceptions", [e]):
            for line in str(f).splitlines():
                if m := re.search(r"violates `(\w+)` at (\S+)", line):  # e.g. temperature: type
                    where = re.sub(r"/anyOf/\d+|/properties", "", m[2]).strip("/")
                    figures.lenient[f"{where}: {m[1]}"] += 1
    if 400 <= status < 500:
        try:
            err = resp.json()["error"]
            ok = isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            figures.failures.append(f"{where}\n  not an OpenAI-style error: {resp.text[:300]!r}")
    elif status == 200 and "text/event-stream" in resp.headers.get("Content-Type", ""):
        if not resp.text.rstrip().endswith("data: [DONE]"):
            figures.failures.append(f"{where}\n  a stream without [DONE]: {resp.text[-300:]!r}")


def _deepest_string(body: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The keys down to the most deeply nested string value in a JSON body (keys may hold dots,
    or be empty: a path of keys, not a dotted string)."""
    found: list[tuple[str | int, ...]] = []
    if isinstance(body, str):
        found.append(path)
    elif isinstance(body, dict | list):
        for k, v in body.items() if isinstance(body, dict) else enumerate(body):
            if (p := _deepest_string(v, (*path, k))) is not None:
                found.append(p)
    return max(found, key=len, default=None)


def _named(keys: tuple[str | int, ...]) -> str:
    """How the API names that place in an error's `param` (`messages.0.content`: keys joined by dots,
    as schema/body.py writes it, an empty key leaving no mark)."""
    name = ""
    for k in keys:
        name = f"{name}.{k}" if name else str(k)
    return name


def _lone_surrogate(case: Any, base_url: str, session: requests.Session, figures: Figures) -> None:
    """The case's body again with its deepest string made a lone surrogate ("\\ud800", issue 36
    item 6): whatever the body, a 400 naming that string."""
    if not isinstance(case.body, dict) or (keys := _deepest_string(case.body)) is None:
        return
    body = copy.deepcopy(case.body)
    *parents, last = keys
    node = body
    for key in parents:
        node = node[key]
    node[last] = "x\ud800"
    where = _named(keys)
    resp = session.post(base_url + case.formatted_path, data=json.dumps(body), headers=AUTH, timeout=60)
    figures.faults["lone_surrogate"] += 1
    err = resp.json().get("error", {}) if resp.headers.get("Content-Type", "").startswith("application/json") else {}
    named = err.get("param") == where or (case.formatted_path.startswith("/v1/messages")  # Anthropic's: no param
                                          and str(err.get("message")).startswith(where + ":"))
    if resp.status_code != 400 or not named:
        figures.failures.append(f"{case.operation.label} with {where} a lone surrogate -> {resp.status_code}: "
                                f"{resp.text[:300]}")


def _fuzz(base_url: str, doc: dict, examples: int, seed: int | None, figures: Figures) -> None:
    """Every operation in positive and negative mode, `examples` cases each (blocking: a thread)."""
    schema = _schema(doc)
    session = requests.Session()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.body else [])
        for mode in modes:
            @hypothesis.given(case=op.as_strategy(mode))
            @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
                                 phases=[hypothesis.Phase.generate], report_multiple_bugs=True,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            def run(case: Any) -> None:
                figures.requests += 1
                try:
                    resp = case.call(base_url=base_url, session=session, headers=AUTH, timeout=60)
                except requests.RequestException as e:
                    figures.lost.append(f"{case.operation.label}: {type(e).__name__}: {e}"[:300])
                    return
                _check(case, resp, figures)
                if resp.status_code == 200:
                    _lone_surrogate(case, base_url, session, figures)

            if seed is not None:
                run = hypothesis.seed(seed)(run)
            run()


async def _cut_streams(stack: ToyStack, stop: asyncio.Event, figures: Figures) -> None:
    """A client that goes away after its stream's first chunk, again and again."""
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with aiohttp.ClientSession(headers=AUTH) as http:
            async with http.post(stack.base_url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.content.readline()
        figures.faults["stream_cut"] += 1
        await asyncio.sleep(0.2)  # a fault now and then, not a flood


async def _slow_loris(stack: ToyStack, stop: asyncio.Event, figures: Figures) -> None:
    """Connections that send their request head a byte every 0.2 s: each must be closed unanswered."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n" * 2
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(host, int(port))
        closed = asyncio.create_task(reader.read())
        for i in range(len(head)):
            if closed.done():
                break
            writer.write(head[i:i + 1])
            await asyncio.sleep(0.2)  # slow-loris: a byte at a time
        try:
            assert await asyncio.wait_for(closed, 10) == b"", "a slow head got an answer"
        except ConnectionResetError:  # closed with our bytes unread: a reset, as good
            pass
        writer.close()
        figures.faults["slow_loris"] += 1


async def fuzz_stack(nats_url: str, examples: int, seed: int | None = None) -> Figures:
    figures = Figures()
    async with toy_stack(nats_url, frontend=FRONTEND, engine=ENGINE) as stack:
        async with aiohttp.ClientSession() as http, http.get(stack.base_url + "/openapi.json") as r:
            doc = await r.json()
        stop = asyncio.Event()
        faults = [asyncio.create_task(f(stack, stop, figures)) for f in (_cut_streams, _slow_loris)]
        try:
            await asyncio.to_thread(_fuzz, stack.base_url, doc, examples, seed, figures)
        finally:
            stop.set()
            await asyncio.gather(*faults)
        # Still serving, nothing left behind.
        async with aiohttp.ClientSession(headers=AUTH) as http:
            async with http.post(stack.base_url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "He"
            async with http.get(stack.base_url + "/metrics") as r:
                figures.server_5xx = [ln for ln in (await r.text()).splitlines()
                                      if ln.startswith("moebus_frontend_http_requests_total{") and 'status="5' in ln]
        await stack.wait_idle(timeout=15)
    return figures


def _verdict(figures: Figures) -> None:
    print("\nfuzz:", figures.summary())
    assert not figures.lost, figures.lost[:5]
    assert not figures.failures, f"{len(figures.failures)} failures:\n" + "\n".join(figures.failures[:10])
    assert not any(s >= 500 for s in figures.statuses) and not figures.server_5xx, figures.server_5xx


async def test_fuzz_openapi(nats_server) -> None:
    started = time.monotonic()
    figures = await fuzz_stack(nats_server.url, examples=25)
    _verdict(figures)
    assert figures.requests >= 100 and figures.faults["slow_loris"] >= 1, figures.summary()
    print(f"fuzz: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
async def test_fuzz_openapi_large(nats_server) -> None:
    figures = await fuzz_stack(nats_server.url, examples=500, seed=20)
    _verdict(figures)

