"""Stop strings across token boundaries and stateless incremental detokenization."""
from __future__ import annotations

import pytest

from moebus.devmodel.toy import EOS, ToyTokenizer
from moebus.text.detokenizer import decode_step
from moebus.text.stop_strings import apply_stops, held_suffix_len


def stream_stops(deltas: list[str], stops: list[str], include_stop: bool = False) -> tuple[str, bool]:
    out, held = "", ""
    for i, d in enumerate(deltas):
        text, held, stopped = apply_stops(held, d, stops, include_stop=include_stop, finished=i == len(deltas) - 1)
        out += text
        if stopped:
            return out, True
    return out, False


def test_held_suffix() -> None:
    assert held_suffix_len("abc\n", ["\n\n"]) == 1
    assert held_suffix_len("abcEN", ["END"]) == 2
    assert held_suffix_len("abc", ["END"]) == 0
    assert held_suffix_len("xE", ["END", "EX"]) == 1


@pytest.mark.parametrize(("deltas", "stops", "include", "want"), [
    (["Hello", " wor", "ld"], ["world"], False, ("Hello ", True)),  # spans three deltas
    (["Hel", "lo\n", "\nmore"], ["\n\n"], False, ("Hello", True)),
    (["Hel", "lo\n", "\nmore"], ["\n\n"], True, ("Hello\n\n", True)),
    (["ab", "cE", "Nx", "END"], ["END"], False, ("abcENx", True)),  # false start, then the real one
    (["a", "b", "c"], ["zz"], False, ("abc", False)),
    (["abc", "E"], ["END"], False, ("abcE", False)),  # held tail is released at the end
    (["xx", "STOP1"], ["STOP1", "STOP"], False, ("xx", True)),
])
def test_stops(deltas: list[str], stops: list[str], include: bool, want: tuple[str, bool]) -> None:
    assert stream_stops(deltas, stops, include) == want


def test_earliest_stop_wins() -> None:
    assert apply_stops("", "a-b+c", ["+", "-"]) == ("a", "", True)


@pytest.mark.parametrize(("text", "stops", "include", "want"), [
    ("xabc", ["a", "ab"], True, "xa"),  # "a" is complete first: generation never reaches the "b"
    ("xabc", ["ab", "a"], True, "xa"),  # the order of the list does not matter
    ("xabc", ["a", "ab"], False, "x"),
    ("abc", ["abc", "b"], False, "a"),  # ends first beats starts first
    ("xab", ["b", "ab"], False, "x"),  # same end: the one starting earlier
    ("xx STOP1", ["STOP1", "STOP"], True, "xx STOP"),
])
def test_first_complete_stop_wins(text: str, stops: list[str], include: bool, want: str) -> None:
    assert apply_stops("", text, stops, include_stop=include) == (want, "", True)


def splits(text: str) -> list[list[str]]:
    """Every way to cut `text` into non-empty deltas."""
    out = []
    for mask in range(2 ** (len(text) - 1)):
        cuts = [0] + [i + 1 for i in range(len(text) - 1) if mask >> i & 1] + [len(text)]
        out.append([text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])
    return out


@pytest.mark.parametrize(("text", "stops"), [
    ("xabcab", ["a", "ab"]), ("abcbc", ["abc", "b"]), ("aabab", ["ab", "aab", "bab"]), ("xENENDy", ["END", "NE"]),
    ("hello", ["zz", "lo"]), ("abab", ["x"]),
])
@pytest.mark.parametrize("include", [False, True])
def test_token_boundaries_do_not_change_the_result(text: str, stops: list[str], include: bool) -> None:
    want = stream_stops([text], stops, include)
    for deltas in splits(text):
        assert stream_stops(deltas, stops, include) == want, deltas


def test_empty_stop_strings_are_ignored() -> None:
    assert apply_stops("", "abc", ["", "c"]) == ("ab", "", True)
    assert apply_stops("", "abc", [""]) == ("abc", "", False)


def incremental(tok, prompt: list[int], out: list[int], skip: frozenset[int]) -> str:
    """Drive decode_step the way the frontend does: window + offsets, one token at a time."""
    window, read, text = list(prompt[-6:]), len(prompt[-6:]), ""
    for i, t in enumerate(out):
        window.append(t)
        delta, prefix, read = decode_step(tok, window, read, skip, finished=i == len(out) - 1)
        window, read = window[prefix:], read - prefix
        text += delta
    return text


def test_toy_multibyte_characters_wait_for_their_last_byte() -> None:
    tok = ToyTokenizer()
    ids = tok.encode("Ünï 日本語!")
    window, read = [], 0
    deltas = []
    for t in ids:
        window.append(t)
        delta, prefix, read = decode_step(tok, window, read, frozenset([EOS]))
        window, read = window[prefix:], read - prefix
        deltas.append(delta)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == "Ünï 日本語!"
    assert deltas[:2] == ["", "Ü"]  # U+00DC is two bytes: nothing after the first


def test_toy_specials_are_skipped() -> None:
    tok = ToyTokenizer()
    assert incremental(tok, tok.encode("hi"), tok.encode("ok") + [EOS], frozenset([EOS])) == "ok"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    pytest.importorskip("torch")
    from moebus.text.tokenizer import load_tokenizer

    try:
        return load_tokenizer("smollm2")
    except FileNotFoundError:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")


@pytest.mark.parametrize("text", ["Hello 日本語 world!", "  leading spaces\n\nand 12345 digits", "émoji 🙂 ok"])
def test_byte_level_bpe_incremental_equals_full_decode(smollm2_tokenizer, text: str) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    out = tok.encode(text)
    skip = frozenset(getattr(tok, "special_ids", ()) or tok.eos_token_ids)
    assert incremental(tok, prompt, out, skip) == tok.decode(out)
