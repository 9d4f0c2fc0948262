"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py with its gguf-py), from the
`llama-cpp-python` sdist on PyPI, so GGUF tests and benchmark checkpoints are files written the way users' are.

Fetched once into the moebus cache (~77 MB download); its one extra import, sentencepiece, goes
into a folder beside it, never into the project's venv."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from moebus.text.gguf import cache_root

VERSION = "0.3.36"  # the tree loadtest/peers/setup_llama_server.sh builds llama-server from


def converter_root() -> Path:
    """The vendored llama.cpp tree holding convert_hf_to_gguf.py, fetched on first use."""
    root = cache_root() / f"llama-cpp-python-{VERSION}"
    tree = root / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists() and (root / "deps").exists():
        return tree
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        f"llama-cpp-python=={VERSION}"], check=True)
        staging = Path(tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-llama-cpp-"))
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and (
                m.name.endswith(".py") or "/gguf-py/" in m.name)]
            tar.extractall(staging, members=members, filter="data")
        subprocess.run([*pip, "install", "--target", str(next(staging.iterdir()) / "deps"), "sentencepiece"],
                       check=True)
        os.replace(next(staging.iterdir()), root)  # atomic: a concurrent run sees none or all of it
        staging.rmdir()
    return tree


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    tree = converter_root()
    env = {**os.environ, "PYTHONPATH": f"{tree / 'gguf-py'}{os.pathsep}{tree.parent.parent / 'deps'}"}
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
                    "--outtype", outtype], check=True, env=env, capture_output=True)
    return out
