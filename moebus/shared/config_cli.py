"""Map a pydantic config model onto argparse flags (``--field-name``), and back."""
from __future__ import annotations

import argparse
import inspect
import json
import re
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel


def add_model_args(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per field; lists are comma-separated, dicts and nested models are JSON, bools take true/false.
    A field's help is its description, else the comment that documents it in the class source."""
    comments = field_comments(model)
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        about = (field.description or comments.get(name, "")).replace("%", "%%")
        default = field.default_factory() if field.default_factory is not None else field.default
        parser.add_argument(flag, dest=name, default=None, metavar=name.upper(),
                            help=f"{about} (default: {default!r})".strip().replace("%(", "%%("))


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment beside it (`x: int = 1  # ...`) or the comment lines just above
    it, from the source of the model and its bases (nearest class wins)."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            lines = inspect.getsource(cls).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines:
            text = line.strip()
            if text.startswith("#"):
                above.append(text.lstrip("# ").strip())
                continue
            m = _FIELD.match(line)
            if m:
                beside = m.group(2).strip() if m.group(2) else ""
                out[m.group(1)] = " ".join([*above, beside]).strip()
            above = []
    return out


_FIELD = re.compile(r"^    (\w+)\s*:[^#]*?(?:#(.*))?$")


def model_from_args(model: type[BaseModel], args: argparse.Namespace, **overrides: Any) -> BaseModel:
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = getattr(args, name, None)
        if raw is not None:
            values[name] = _parse(raw, field.annotation)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return model.model_validate(values)


def _parse(raw: str, annotation: Any) -> Any:
    union = get_origin(annotation) in (Union, UnionType)
    kinds = {get_origin(a) or a for a in (get_args(annotation) if union else (annotation,))}
    if list in kinds:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if dict in kinds or any(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds):
        return json.loads(raw)
    if bool in kinds:
        return raw.lower() in ("1", "true", "yes", "on")
    return raw  # pydantic coerces numbers and literals


def to_cli_args(cfg: BaseModel) -> list[str]:
    """The flags that rebuild `cfg` in a child process (only fields that differ from defaults)."""
    out: list[str] = []
    for name, value in cfg.model_dump(exclude_defaults=True).items():
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(map(str, value))
        elif isinstance(value, dict):
            value = json.dumps(value)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        out += ["--" + name.replace("_", "-"), str(value)]
    return out
