"""Prompt synthesis: exact token counts and exactly shared prefix blocks, for the toy tokenizer
and the embedded SmolLM2 tokenizer."""
from __future__ import annotations

import pytest

from moebus.loadtest.prompts import PromptSynth, load_tokenizer
from moebus.loadtest.trace import TraceRequest


@pytest.fixture(scope="module", params=["toy", "smollm2"])
def tok(request: pytest.FixtureRequest):
    try:
        return load_tokenizer(request.param)
    except Exception as e:  # the embedded GGUF is an optional package
        pytest.skip(f"{request.param} tokenizer not available: {e}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_exact_token_counts(tok) -> None:
    synth = PromptSynth(tok, block_tokens=16)
    for i, n in enumerate([1, 2, 15, 16, 17, 100, 999]):
        assert len(tok.encode(synth.prompt(TraceRequest(0, n, 1), i))) == n
    for i, n in enumerate([5, 40, 70]):  # with hash ids, past and short of the blocks they name
        assert len(tok.encode(synth.prompt(TraceRequest(0, n, 1, hash_ids=[1, 2, 3]), 100 + i))) == n


def test_shared_hash_ids_share_exactly_those_blocks(tok) -> None:
    b = 16
    synth = PromptSynth(tok, block_tokens=b)
    a = tok.encode(synth.prompt(TraceRequest(0, 64, 1, hash_ids=[1, 2, 3, 4]), 0))
    c = tok.encode(synth.prompt(TraceRequest(0, 80, 1, hash_ids=[1, 2, 9, 4, 5]), 1))
    d = tok.encode(synth.prompt(TraceRequest(0, 40, 1, hash_ids=[7, 2]), 2))
    assert common_prefix(a, c) >= 2 * b and a[2 * b:3 * b] != c[2 * b:3 * b]
    assert a[:b] != d[:b] and a[b:2 * b] == d[b:2 * b], "the same id is the same block, wherever it sits"
    again = tok.encode(PromptSynth(tok, block_tokens=b).prompt(TraceRequest(0, 64, 1, hash_ids=[1, 2, 3, 4]), 5))
    assert again == a, "blocks depend on the id and the seed only"


def test_no_sharing_without_hash_ids_unless_asked(tok) -> None:
    synth = PromptSynth(tok, block_tokens=16)
    a, c = (tok.encode(synth.prompt(TraceRequest(0, 200, 1), i)) for i in (0, 1))
    assert common_prefix(a, c) < 4
    shared = PromptSynth(tok, block_tokens=16, shared_prefix_tokens=50)
    a, c = (tok.encode(shared.prompt(TraceRequest(0, 200, 1), i)) for i in (0, 1))
    assert common_prefix(a, c) >= 50 and a[50:60] != c[50:60]


def test_each_run_gets_fresh_prompts_unless_seeded(tmp_path) -> None:
    """A rerun against a warm server must not hit the prefix cache its previous run left."""
    from moebus.loadtest.session import LoadTest, build_prompts

    reqs = [TraceRequest(0, 30, 1), TraceRequest(0, 30, 1, hash_ids=[4])]
    runs = [build_prompts(reqs, LoadTest("http://x", tmp_path, tokenizer="toy")) for _ in range(2)]
    assert runs[0][0] != runs[1][0] and runs[0][1] != runs[1][1]
    seeded = [build_prompts(reqs, LoadTest("http://x", tmp_path, tokenizer="toy", prompt_seed=5)) for _ in range(2)]
    assert seeded[0] == seeded[1]
