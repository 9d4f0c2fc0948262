"""The module maps are checked, not trusted: every backticked `path.py` or `path.py:Name` anchor in
docs/ARCHITECTURE.md and moebus/services/README.md names a file that exists and, after the colon,
a top-level function, class or assignment of that file, or `Class.member` (a method or a class-body
assignment). Paths are relative to moebus/ (the docs' convention) or to the repository root."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAPS = ("docs/ARCHITECTURE.md", "moebus/services/README.md")
ANCHOR = re.compile(r"`([\w./-]+\.py)(?::([A-Za-z_][\w.]*))?`")


def anchors() -> list[tuple[str, str, str | None]]:
    out = []
    for doc in MAPS:
        path = REPO / doc
        if path.is_file():
            out += [(doc, m[1], m[2]) for m in ANCHOR.finditer(path.read_text())]
    return out


def resolve(rel: str) -> Path | None:
    for base in (REPO / "moebus", REPO):
        if (base / rel).is_file():
            return base / rel
    return None


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING` / try-import
            names.update(_bound(node.body))
    return names


@cache
def top_level(path: Path) -> dict[str, ast.AST]:
    return _bound(ast.parse(path.read_text(), filename=str(path)).body)


def defines(path: Path, name: str) -> bool:
    head, *rest = name.split(".")
    node = top_level(path).get(head)
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return False
        node = _bound(node.body).get(part)
    return node is not None


def test_the_maps_have_anchors():
    assert len(anchors()) >= 50, "docs/ARCHITECTURE.md should name where things live as `file.py:Name`"


@pytest.mark.parametrize("doc,rel,name", anchors(), ids=lambda v: v if isinstance(v, str) else "")
def test_anchor_names_real_code(doc, rel, name):
    path = resolve(rel)
    assert path is not None, f"{doc}: `{rel}` is not a file under moebus/ or the repository root"
    if name:
        assert defines(path, name), f"{doc}: {rel} defines no `{name}` (top-level, or Class.member)"
