"""The wheel a container build makes (`pip install .`) holds every module, and each imports from it.

The editable install of ./run would hide a package left out of the wheel; this builds the wheel,
unpacks it into a fresh directory and imports every module of it there, with this environment's
dependencies and nothing of the source tree on the path.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, pkgutil, sys
import moebus
assert moebus.__file__.startswith(sys.argv[1]), moebus.__file__  # the wheel's copy, not the tree's
names = [m.name for m in pkgutil.walk_packages(moebus.__path__, "moebus.")]
for name in names:
    importlib.import_module(name)
    print(name)
"""


def test_wheel_ships_and_imports_every_module(tmp_path: Path) -> None:
    # A clean copy: setuptools' build/ folder in the tree would carry files deleted since.
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT / "moebus", src / "moebus", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(src)], check=True, cwd=tmp_path)
    (wheel,) = dist.glob("moebus-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    shipped = {p.relative_to(site).as_posix() for p in site.rglob("*.py")}
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moebus").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert in_tree <= shipped, sorted(in_tree - shipped)
    assert any(p.name.endswith(".c") for p in (site / "moebus" / "kernels" / "csrc").iterdir())
    assert (site / "moebus" / "text" / "templates" / "smollm2_tools.jinja").is_file()  # the shipped chat template
    assert {p.name for p in (site / "moebus" / "eval" / "data").iterdir()} >= {"prompts.txt", "declaration_gettysburg.txt"}
    # -P: not the working directory on sys.path; PYTHONPATH puts the wheel before the editable install.
    out = subprocess.run([sys.executable, "-P", "-c", IMPORT_ALL, str(site)], cwd=tmp_path,
                         capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(out.stdout.split())
    modules = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in shipped}
    assert imported == modules - {"moebus"}
