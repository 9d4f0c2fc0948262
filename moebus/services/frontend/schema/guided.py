"""Structured outputs over HTTP: OpenAI's `response_format`, vLLM's `structured_outputs` object
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extras, all
mapped to one wire StructuredOptions, which names the field it came from. A request may carry one
constraint: a second one is a 400 naming it. Schemas, regexes and grammars are bounded in size
here; the worker's engine compiles them under a deadline and budgets what following them costs
each step (an invalid one, or one past either, is a 400 naming the field, from there)."""
from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import Field, ValidationInfo, field_validator, model_validator

from moebus.shared.messages import StructuredOptions

from .fields import ParamError, _Req, limits_of

_MAX_CHOICES = 256


class JsonSchemaFormat(_Req):
    name: str = Field("schema", max_length=256)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return check_schema(v, info)


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class StructuredOutputs(_Req):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None  # vLLM's tool-call tags: not supported (a 400 when given)

    @field_validator("json_")
    @classmethod
    def _json(cls, v: Any, info: ValidationInfo) -> Any:
        return None if v is None else check_schema(v, info)

    @field_validator("regex", "grammar")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else check_text(v, info)

    @field_validator("choice")
    @classmethod
    def _choice(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        return None if v is None else check_choice(v, info)

    def constraints(self, prefix: str) -> list[tuple[str, StructuredOptions]]:
        if self.structural_tag is not None:
            raise ParamError(f"{prefix}.structural_tag", "structural_tag is not supported")
        found = [(f"{prefix}.{name}", opts) for name, value, opts in (
            ("json", self.json_, lambda v: StructuredOptions(json_schema=v)),
            ("json_object", self.json_object or None, lambda v: StructuredOptions(json_object=True)),
            ("regex", self.regex, lambda v: StructuredOptions(regex=v)),
            ("choice", self.choice, lambda v: StructuredOptions(choice=v)),
            ("grammar", self.grammar, lambda v: StructuredOptions(grammar=v)),
        ) for opts in ([opts(value)] if value is not None else [])]
        if not found:
            raise ParamError(prefix, "structured_outputs needs one of json, json_object, regex, choice, grammar")
        return found


class GuidedFields(_Req):
    """The request fields that constrain the output, and their mapping to StructuredOptions."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v: Any, info: ValidationInfo) -> Any:
        return None if v is None else check_schema(v, info)

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _guided_text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else check_text(v, info)

    @field_validator("guided_choice")
    @classmethod
    def _guided_choice(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        return None if v is None else check_choice(v, info)

    @model_validator(mode="after")
    def _one_constraint(self) -> GuidedFields:
        self.structured()
        return self

    def structured(self) -> StructuredOptions | None:
        """The request's one constraint (None: free text); ParamError naming the second one given."""
        found: list[tuple[str, StructuredOptions]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOptions(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", StructuredOptions(json_schema=rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints("structured_outputs")
        for name, value, key in (("guided_json", self.guided_json, "json_schema"),
                                 ("guided_regex", self.guided_regex, "regex"),
                                 ("guided_choice", self.guided_choice, "choice"),
                                 ("guided_grammar", self.guided_grammar, "grammar")):
            if value is not None:
                found.append((name, StructuredOptions(**{key: value})))
        if len(found) > 1:
            raise ParamError(found[1][0], f"only one output constraint per request: {found[1][0]} and "
                                          f"{found[0][0]} are both given")
        return found[0][1].model_copy(update={"param": found[0][0]}) if found else None  # errors name it


def check_schema(v: dict[str, Any] | str, info: ValidationInfo) -> dict[str, Any]:
    """A JSON schema (an object, or its JSON text) within the deployment's size and depth."""
    if isinstance(v, str):
        try:
            v = orjson.loads(v)  # as the body's text: a lone surrogate ("\\ud800") is refused, not carried on
        except ValueError as e:
            raise ValueError(f"the schema is not valid JSON ({e})") from None
        if not isinstance(v, dict):
            raise ValueError("the schema must be a JSON object")
    lim = limits_of(info)
    if _depth(v) > lim.max_schema_depth:
        raise ValueError(f"the schema nests deeper than {lim.max_schema_depth} levels")
    if len(orjson.dumps(v)) > lim.max_schema_bytes:
        raise ValueError(f"the schema is larger than {lim.max_schema_bytes} bytes as JSON")
    return v


def check_text(v: str, info: ValidationInfo) -> str:
    """A regex or grammar: not empty, within the schema size limit."""
    if not v:
        raise ValueError("must not be empty")
    if len(v.encode()) > (most := limits_of(info).max_schema_bytes):
        raise ValueError(f"must be at most {most} bytes")
    return v


def check_choice(v: list[str], info: ValidationInfo) -> list[str]:
    if not v:
        raise ValueError("must list at least one option")
    if len(v) > _MAX_CHOICES:
        raise ValueError(f"at most {_MAX_CHOICES} options")
    if sum(len(c.encode()) for c in v) > (most := limits_of(info).max_schema_bytes):
        raise ValueError(f"the options must total at most {most} bytes")
    return v


def _depth(obj: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (node.values() if isinstance(node, dict) else node))
    return deepest
