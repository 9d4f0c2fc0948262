"""GET /openapi.json: the routes and the request schemas we accept, from the pydantic models."""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionRequest, CompletionRequest

_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}


def openapi_document(version: str = "0.1.0") -> dict:
    _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                 ref_template="#/components/schemas/{model}")
    schemas = {**defs.get("$defs", {}), "Error": _ERROR}

    def post(summary: str, schema: str) -> dict:
        errors = {str(s): {"description": d, "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/Error"}}}} for s, d in (
            (400, "bad request"), (401, "bad API key"), (404, "unknown model"), (413, "request too large"),
            (429, "overloaded"), (503, "unavailable"), (500, "internal error"))}
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
            "/health": {"get": {"summary": "Health", "responses": {"200": {"description": "ok"},
                                                                    "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
