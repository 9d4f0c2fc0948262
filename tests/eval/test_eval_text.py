"""The evaluation inputs: shipped data, header stripping, llama-perplexity's chunking."""
from __future__ import annotations

import pytest

from moebus.eval.text import DEFAULT_PROMPTS, DEFAULT_TEXT, chunks, read_prompts, read_text


def test_shipped_text_says_what_it_is_and_that_it_is_public_domain() -> None:
    header = DEFAULT_TEXT.read_text(encoding="utf-8").splitlines()[0]
    assert header.startswith("#") and "public domain" in header and "1776" in header
    text = read_text(DEFAULT_TEXT)
    assert text.startswith("IN CONGRESS, July 4, 1776.")
    assert "Four score and seven years ago" in text and "#" not in text


def test_shipped_prompts() -> None:
    prompts = read_prompts(DEFAULT_PROMPTS)
    assert len(prompts) == 30 and len(set(prompts)) == 30
    assert prompts[0] == "What is the capital of France?"


def test_chunks_score_the_second_half() -> None:
    cs = chunks(list(range(10)), 4)
    assert [c.tokens for c in cs] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the tail (8, 9) is dropped
    assert cs[0].first == 2 and cs[0].targets == [3]
    assert [c.tokens for c in chunks(list(range(10)), 4, max_chunks=1)] == [[0, 1, 2, 3]]
    assert len(chunks(list(range(512)), 512)[0].targets) == 255


def test_a_text_shorter_than_one_chunk_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 tokens, fewer than --ctx 4"):
        chunks([1, 2, 3], 4)
