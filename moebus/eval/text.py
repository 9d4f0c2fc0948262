"""The evaluation inputs: the fixed text cut into chunks, and the prompt set.

Chunks follow llama-perplexity: `ctx` tokens each (the tail that does not fill one is dropped);
the first half is context only, and the logits of positions ctx/2 .. ctx-2 are scored against
the next token, so every scored prediction sees at least ctx/2 tokens of context.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
DEFAULT_TEXT = DATA / "declaration_gettysburg.txt"
DEFAULT_PROMPTS = DATA / "prompts.txt"


def read_text(path: str | Path) -> str:
    """The file's text without its header: leading lines that start with '#' (what it is, licence)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line."""
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True, slots=True)
class Chunk:
    tokens: list[int]  # ctx token ids

    @property
    def first(self) -> int:
        """Index of the first scored logit row (it predicts token first + 1)."""
        return len(self.tokens) // 2

    @property
    def targets(self) -> list[int]:
        """The scored tokens: each is predicted by the row before it."""
        return self.tokens[self.first + 1:]


def chunks(ids: list[int], ctx: int, max_chunks: int | None = None) -> list[Chunk]:
    if ctx < 4:
        raise ValueError(f"--ctx must be >= 4, got {ctx}")
    n = len(ids) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --ctx {ctx}")
    if max_chunks is not None:
        n = min(n, max_chunks)
    return [Chunk(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]
