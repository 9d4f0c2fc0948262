"""Text that UTF-8 cannot carry (issue 36 item 6): a lone surrogate ("\\ud800" escaped, or bytes
that are not UTF-8) anywhere in a body is a 400 naming the field on every endpoint, through real
HTTP on the toy stack; never a 500 from rendering or the bus. Chat and completions fields are in
test_edge_limits.py's corpus; here the other endpoints and nested definitions.
"""
from __future__ import annotations

import aiohttp
import pytest

from moebus.services.frontend.schema.body import _unencodable

from ..conftest import ToyStack
from .test_edge_limits import _no_5xx

CHAT = '{"model": "toy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'


def _add(base: str, fields: str) -> str:
    """`base` (a JSON object's text) with `fields` spliced in as written: no encoder writes these."""
    return f"{base[:-1]}, {fields}}}"


def _tool(properties: str) -> str:
    fn = f'{{"name": "f", "parameters": {{"properties": {properties}}}}}'
    return f'"tools": [{{"type": "function", "function": {fn}}}]'


# (path, the body's JSON text, the param the 400 names). A surrogate character in the text is sent
# as the byte it escapes (surrogateescape): "\udcff" goes out as 0xff.
CASES: list[tuple[str, str, str]] = [
    ("/v1/chat/completions", _add(CHAT, _tool('{"x": {"description": "\\udc00"}}')),
     "tools.0.function.parameters.properties.x.description"),
    ("/v1/chat/completions", _add(CHAT, _tool('{"\\ud800": {"type": "string"}}')),
     "tools.0.function.parameters.properties.\\ud800"),
    ("/v1/chat/completions", '{"model": "toy", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
     '"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": "\\ud800"}}}]}]}',
     "messages.1.tool_calls.0.function.arguments.a"),
    ("/v1/chat/completions", '{"model": "toy", "messages": [{"role": "system", "content": "\udcff"}]}',
     "messages.0.content"),
    ("/v1/completions", '{"model": "toy", "prompt": ["a", "b", "\\udfff"]}', "prompt.2"),
    ("/v1/responses", '{"model": "toy", "input": "\\ud800"}', "input"),
    ("/v1/responses", '{"model": "toy", "input": [{"role": "user", "content": [{"type": "input_text", '
     '"text": "\\udbff x"}]}]}', "input.0.content.0.text"),
    ("/v1/responses", '{"model": "toy", "input": "hi", "instructions": "\udce9"}', "instructions"),
    ("/v1/responses", '{"model": "toy", "input": "hi", "metadata": {"k": "\\ud800"}}', "metadata.k"),
    ("/v1/responses", '{"model": "toy", "input": "hi", "tools": [{"type": "function", "name": "f", '
     '"description": "\\ud800"}]}', "tools.0.description"),
    ("/v1/messages", _add(CHAT, '"system": "\\ud800"'), "system"),
    ("/v1/messages", _add(CHAT, '"stop_sequences": ["\\udc00"]'), "stop_sequences.0"),
    ("/v1/messages", _add(CHAT, '"metadata": {"user_id": "\\ud800"}'), "metadata.user_id"),
    ("/v1/messages", _add(CHAT, '"tools": [{"name": "f", "input_schema": {"type": "object", "properties": '
                                '{"a": {"enum": ["\\ud800"]}}}}]'), "tools.0.input_schema.properties.a.enum.0"),
    ("/v1/messages/count_tokens", '{"model": "toy", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud800"}]}]}', "messages.0.content.0.text"),
    ("/tokenize", '{"model": "toy", "prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions", '"\\ud800"', "the body"),  # not even an object
]


async def _post(http: aiohttp.ClientSession, url: str, text: str) -> tuple[int, dict]:
    async with http.post(url, data=text.encode("utf-8", "surrogateescape"),
                         headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_unencodable_text_is_a_400_naming_the_field(stack: ToyStack) -> None:
    failures = []
    async with aiohttp.ClientSession() as http:
        for path, text, param in CASES:
            status, body = await _post(http, stack.base_url + path, text)
            err = body.get("error", {})
            if path.startswith("/v1/messages"):  # Anthropic's shape: no param; the message names it
                ok = err.get("type") == "invalid_request_error" and err["message"].startswith(param + ":")
            else:
                ok = (err.get("type"), err.get("code")) == ("invalid_request_error", "invalid_value") and \
                    err.get("param") == (None if param == "the body" else param) and param in err["message"]
            if status != 400 or not ok:
                failures.append(f"{path} {text[:80]!r}: {status} {body}")
        r = await stack.client().chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)
        assert r.choices[0].message.content == "He"
    assert not failures, "\n".join(failures)
    await _no_5xx(stack)


@pytest.mark.parametrize("text, status, param", [
    # A surrogate pair is one character: fine, also when another field sends the body the slow way (NaN).
    ('{"model": "toy", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', 200, None),
    ('{"model": "toy", "temperature": NaN, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', 400,
     "temperature"),
    # Tool-call arguments as JSON text holding the escape of a lone surrogate: the text goes to the
    # template as it came (it is valid UTF-8), not decoded into a string the tokenizer cannot take.
    ('{"model": "toy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
     '"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{\\"a\\": \\"\\\\ud800\\"}"}}]}, '
     '{"role": "tool", "tool_call_id": "c", "content": "ok"}]}', 200, None),
    # Nested past max_json_depth, the lone surrogate at the bottom: a 400 all the same.
    (_add('{"model": "toy", "messages": []}', '"x": ' + "[" * 400 + '"\\ud800"' + "]" * 400), 400, "x" + ".0" * 400),
])
async def test_what_stays_valid(stack: ToyStack, text: str, status: int, param: str | None) -> None:
    async with aiohttp.ClientSession() as http:
        got, body = await _post(http, stack.base_url + "/v1/chat/completions", text)
    assert got == status, body
    if param is not None:
        assert body["error"]["param"] == param, body
    await _no_5xx(stack)


def test_the_walk_is_a_loop() -> None:
    """Deeper than Python's recursion limit (json.loads stops near it; the walk must not)."""
    deep: list = ["\ud800"]
    for _ in range(5000):
        deep = [deep]
    assert _unencodable({"a": "ok", "b": deep}) == "b" + ".0" * 5001
    assert _unencodable({"a": ["ok", {"\U0001f600": "\U0001f600"}], "b": 1.5}) is None
