"""The sampling parameters live in three mirrors; these tests keep them from drifting apart:
the engine's SamplingParams, the wire SamplingOptions (same names, same defaults), and the HTTP
request models of the frontend, whose mapping must set every SamplingOptions field."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from moebus.engine.sampling.params import SamplingParams, StructuredOutputParams
from moebus.services.frontend.schema.protocol import ChatCompletionRequest, CompletionRequest
from moebus.shared.messages import SamplingOptions, StructuredOptions

# Documented exceptions: fields whose type differs between the mirrors (same name and default).
NESTED = {"structured": (StructuredOutputParams, StructuredOptions)}


def dataclass_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        has_factory = f.default_factory is not dataclasses.MISSING
        out[f.name] = f.default_factory() if has_factory else f.default
    return out


def model_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    return {name: f.get_default(call_default_factory=True) for name, f in cls.model_fields.items()}


@pytest.mark.parametrize(("engine", "wire"), [(SamplingParams, SamplingOptions),
                                              (StructuredOutputParams, StructuredOptions)])
def test_wire_mirrors_the_engine_field_for_field(engine: type, wire: type[BaseModel]) -> None:
    assert dataclass_defaults(engine) == model_defaults(wire)


def test_nested_exceptions_are_still_mirrors() -> None:
    for name, (engine, wire) in NESTED.items():
        assert name in SamplingOptions.model_fields and name in {f.name for f in dataclasses.fields(SamplingParams)}
        assert set(wire.model_fields) == {f.name for f in dataclasses.fields(engine)}


EVERY_KNOB = {  # each SamplingOptions field away from its default
    "n": 2, "best_of": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "max_tokens": 32,
    "min_tokens": 1, "stop": ["END"], "stop_token_ids": [3], "ignore_eos": True, "include_stop_str_in_output": True,
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
    "response_format": {"type": "json_object"}, "logit_bias": {"5": -100},
}
REQUESTS = [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}),
    (CompletionRequest, {"prompt": "hi", "logprobs": 2}),
]


@pytest.mark.parametrize(("cls", "body"), REQUESTS)
def test_the_frontend_maps_every_field(cls: type, body: dict) -> None:
    opts = cls.model_validate({"model": "toy", **EVERY_KNOB, **body}).to_sampling()
    assert opts.model_fields_set == set(SamplingOptions.model_fields)  # each one set by the mapping
    defaults = model_defaults(SamplingOptions)
    unchanged = [name for name in SamplingOptions.model_fields if getattr(opts, name) == defaults[name]]
    assert unchanged == [], f"the request's value never reaches {unchanged}"
    SamplingParams(**{**opts.model_dump(exclude={"structured"}), "structured": None})  # the engine accepts it


def test_default_requests_map_to_the_default_options() -> None:
    assert CompletionRequest(model="toy", prompt="hi").to_sampling() == SamplingOptions()
    chat = ChatCompletionRequest(model="toy", messages=[{"role": "user", "content": "hi"}]).to_sampling()
    assert chat == SamplingOptions(max_tokens=None)  # chat: no max_tokens = up to the rest of the context
