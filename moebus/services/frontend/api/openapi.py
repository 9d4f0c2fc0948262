"""GET /openapi.json: the routes and the request schemas we accept, from the pydantic models,
with this deployment's bounds (RequestLimits) written in, so clients and fuzzers see them."""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from ..config import RequestLimits
from ..schema.protocol import ChatCompletionRequest, CompletionRequest

_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}


def openapi_document(version: str = "0.1.0", limits: RequestLimits | None = None) -> dict:
    _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                 ref_template="#/components/schemas/{model}")
    schemas = {**defs.get("$defs", {}), "Error": _ERROR}
    _bound(schemas, limits or RequestLimits())

    def post(summary: str, schema: str) -> dict:
        errors = {str(s): {"description": d, "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/Error"}}}} for s, d in (
            (400, "bad request"), (401, "bad API key"), (404, "unknown model"), (408, "request body too slow"),
            (413, "request too large"), (429, "overloaded or over a limit"), (503, "unavailable"),
            (500, "internal error"))}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {"200": {"description": "JSON, or text/event-stream when stream is true"}, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "moebus OpenAI-compatible API", "version": version},
        "paths": {
            "/v1/chat/completions": post("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": post("Text completion", "CompletionRequest"),
            "/v1/models": {"get": {"summary": "Served models", "responses": {"200": {"description": "model list"}}}},
            "/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "ok"},
                                                                      "503": {"description": "no bus, or draining"}}}},
            "/ready": {"get": {"summary": "Readiness", "responses": {
                "200": {"description": "a ready worker serves every model"},
                "503": {"description": "OpenAI-style error naming what is missing"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _bound(schemas: dict, lim: RequestLimits) -> None:
    """Write the limits that protocol.py checks from RequestLimits into the request schemas."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        p = schemas[name]["properties"]
        for key in ("n", "best_of"):
            _set(p[key], "integer", maximum=lim.max_n)
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if key in p:
                _set(p[key], "integer", maximum=lim.max_model_len)
        _set(p["stop"], "string", maxLength=lim.max_stop_chars)
        _set(p["stop"], "array", maxItems=lim.max_stop_sequences, items={"type": "string",
                                                                          "maxLength": lim.max_stop_chars})
        _set(p["stop_token_ids"], "array", maxItems=lim.max_stop_token_ids)
        _set(p["top_logprobs" if "top_logprobs" in p else "logprobs"], "integer", maximum=lim.max_logprobs)
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = lim.max_messages
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for form in prompt[1:]:  # a list of strings, of token ids, of lists of token ids: never empty
        form["minItems"] = 1
        form["maxItems"] = lim.max_model_len - 1 if form["items"].get("type") == "integer" else lim.max_prompts
        if form["items"].get("type") == "array":
            form["items"].update(minItems=1, maxItems=lim.max_model_len - 1)


def _set(prop: dict, json_type: str, **bounds: Any) -> None:
    """Add `bounds` to the `json_type` form of a property (itself, or one of its anyOf members)."""
    forms = [f for f in prop.get("anyOf", [prop]) if f.get("type") == json_type]
    if not forms:
        raise ValueError(f"no {json_type} form in {prop}")
    for f in forms:
        f.update(bounds)
