"""Structured output on the real SmolLM2 tokenizer: random-logit "models" steered only by the
grammar mask must produce text that an independent checker accepts."""
from __future__ import annotations

import json
import re

import pytest
import torch

from moebus.engine.sampling import (
    GrammarState,
    Sampler,
    SamplingBatch,
    SamplingParams,
    StructuredOutputCompiler,
    StructuredOutputConfig,
    StructuredOutputParams,
    apply_bitmask,
    bitmask_to_bool,
    make_generator,
    rejection_sample,
)

PAD = 64  # the model's lm_head is wider than the tokenizer's vocab


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def vocab(tok) -> int:
    return len(tok) + PAD


@pytest.fixture(scope="module")
def compiler(tok, vocab) -> StructuredOutputCompiler:
    cfg = StructuredOutputConfig(max_whitespace_cnt=2, max_threads=1)
    return StructuredOutputCompiler(tok, vocab, config=cfg)


@pytest.fixture(scope="module")
def closing_bias(tok, vocab) -> torch.Tensor:
    """Nudge the random model toward tokens that close strings/containers so runs end soon.
    Byte-level token strings spell these ASCII characters as themselves."""
    bias = torch.zeros(vocab)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    bias[[i for i, p in enumerate(pieces) if any(c in p for c in '"}]')]] = 6.0
    bias[tok.eos_token_id] = 30.0  # stop as soon as the grammar allows it
    return bias


def drive(compiler, params, bias, seed, max_steps=300) -> tuple[bool, list[int]]:
    """Sample from random logits through the grammar mask until the grammar terminates."""
    state = compiler.new_state(params)
    gen, sampler, out = make_generator(seed), Sampler(make_generator(seed + 1)), []
    for _ in range(max_steps):
        mask = compiler.allowed_mask([state])
        logits = torch.randn(1, compiler.vocab_size, generator=gen) * 2 + bias
        batch = SamplingBatch.build(
            [SamplingParams()], [out], [[]], [None], compiler.vocab_size, "cpu", allowed_token_mask=mask
        )
        token = sampler(logits, batch).sampled_token_ids.item()
        assert state.accept_token(token), "sampled a token the grammar forbids"
        if state.is_terminated():
            return True, out
        out.append(token)
    return False, out


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


def conforms(value, schema) -> bool:
    """Independent checker for the schema subset used here."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(k in props and conforms(v, props[k]) for k, v in value.items())
        )
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)) and all(
            conforms(v, schema["items"]) for v in value
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return kind == "boolean" and isinstance(value, bool)


@pytest.mark.parametrize("seed", range(3))
def test_json_schema(compiler, closing_bias, tok, seed) -> None:
    done, out = drive(compiler, StructuredOutputParams(json_schema=json.dumps(SCHEMA)), closing_bias, seed)
    assert done
    assert conforms(json.loads(tok.decode(out)), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_object(compiler, closing_bias, tok, seed) -> None:
    done, out = drive(compiler, StructuredOutputParams(json_object=True), closing_bias, seed)
    assert done
    assert isinstance(json.loads(tok.decode(out)), dict)  # OpenAI's json_object: an object, closed


def test_json_object_refuses_an_array_and_a_stop_before_the_close(compiler, tok) -> None:
    state = compiler.new_state(StructuredOutputParams(json_object=True))
    mask = state.allowed_mask()
    assert not mask[tok.encode("[", add_special_tokens=False)[0]] and not mask[tok.eos_token_id]
    ids = tok.encode('{"a": 1', add_special_tokens=False)
    assert state.accept_tokens(ids) == len(ids)
    assert not state.allowed_mask()[tok.eos_token_id]  # not closed yet: no stop
    assert state.accept_token(tok.encode("}", add_special_tokens=False)[0]) and state.allowed_mask()[tok.eos_token_id]


GRAMMAR = r"""root ::= greeting " " name "!"
greeting ::= "hi" | "hello"
name ::= [a-z] [a-z]? [a-z]?"""


@pytest.mark.parametrize("seed", range(3))
def test_grammar(compiler, closing_bias, tok, seed) -> None:
    done, out = drive(compiler, StructuredOutputParams(grammar=GRAMMAR), closing_bias, seed)
    assert done and re.fullmatch(r"(hi|hello) [a-z]{1,3}!", tok.decode(out))
    assert compiler.compile(StructuredOutputParams(grammar=GRAMMAR)).kind == "grammar"


def test_one_constraint_only() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputParams(regex="a", grammar='root ::= "a"')


@pytest.mark.parametrize("seed", range(3))
def test_regex(compiler, closing_bias, tok, seed) -> None:
    pattern = r"[a-z]{2,5}-\d{3}( [A-Z]+)?"
    done, out = drive(compiler, StructuredOutputParams(regex=pattern), closing_bias, seed)
    assert done and re.fullmatch(pattern, tok.decode(out))


@pytest.mark.parametrize("seed", range(4))
def test_choice(compiler, closing_bias, tok, seed) -> None:
    choices = ["yes", "no", 'say "hi"\\', "中文 ok", "no way"]
    done, out = drive(compiler, StructuredOutputParams(choice=choices), closing_bias, seed)
    assert done and tok.decode(out) in choices


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputParams(regex="[a-z"),
        StructuredOutputParams(json_schema="{not json"),
        StructuredOutputParams(json_schema={"type": "foo"}),
        StructuredOutputParams(json_schema={"type": "object", "properties": 3}),
        StructuredOutputParams(json_schema="[1, 2]"),
        StructuredOutputParams(grammar="root ::= undefined_rule"),
        StructuredOutputParams(grammar="not a grammar"),
    ],
)
def test_invalid_grammar_raises_value_error(compiler, params) -> None:
    with pytest.raises(ValueError, match=r"^invalid (regex|json_schema|grammar): [^\[]"):
        compiler.compile(params)


def test_compile_cache(compiler) -> None:
    a = compiler.compile(StructuredOutputParams(json_schema=SCHEMA))
    b = compiler.compile(StructuredOutputParams(json_schema=json.dumps(SCHEMA, indent=2)))
    assert a is b and a.kind == "json_schema"
    reordered = dict(SCHEMA, properties=dict(reversed(SCHEMA["properties"].items())))
    assert compiler.compile(StructuredOutputParams(json_schema=reordered)) is not a  # order matters


def test_padded_vocab_is_never_allowed(compiler, tok, vocab) -> None:
    assert compiler.vocab_size == vocab
    state = compiler.new_state(StructuredOutputParams(regex="ab?"))
    assert state.allowed_mask()[len(tok) :].sum() == 0
    assert state.accept_token(tok.encode("a", add_special_tokens=False)[0]) and state.is_completed()
    mask = state.allowed_mask()
    assert mask[tok.eos_token_id] and not mask[len(tok) :].any()


def test_raw_tokenizers_tokenizer_gives_same_masks(compiler, tok, vocab) -> None:
    raw = StructuredOutputCompiler(tok.backend_tokenizer, vocab, stop_token_ids=[tok.eos_token_id],
                                   config=StructuredOutputConfig(max_threads=1))
    params = StructuredOutputParams(regex=r"\{\"k\": [0-9]+\}")
    a, b = compiler.new_state(params), raw.new_state(params)
    for token in tok.encode('{"k": 12}', add_special_tokens=False):
        assert torch.equal(a.allowed_mask(), b.allowed_mask())
        assert a.accept_token(token) and b.accept_token(token)


def test_rollback_restores_masks(compiler, tok) -> None:
    state = compiler.new_state(StructuredOutputParams(json_schema=SCHEMA))
    tokens = tok.encode('{"name": "bo", "age": 3', add_special_tokens=False)
    masks = []
    for t in tokens:
        masks.append(state.allowed_mask())
        assert state.accept_token(t)
    bad = tok.encode("}", add_special_tokens=False)[0]
    assert not state.accept_token(bad)  # "ok" is required: cannot close yet
    assert state.accept_tokens(tokens[:0]) == 0
    state.rollback(3)
    assert torch.equal(state.allowed_mask(), masks[-3])
    assert state.accept_tokens(tokens[-3:]) == 3
    with pytest.raises(ValueError):
        state.rollback(len(tokens) + 1)


def test_batched_bitmask_and_apply(compiler, tok, vocab) -> None:
    states: list[GrammarState | None] = [
        compiler.new_state(StructuredOutputParams(regex="[0-9]+")),
        None,
        compiler.new_state(StructuredOutputParams(choice=["alpha", "beta"])),
    ]
    bitmask = compiler.fill_bitmask(states)
    allowed = bitmask_to_bool(bitmask, vocab)
    assert allowed[1].all()
    for i in (0, 2):
        assert torch.equal(allowed[i], states[i].allowed_mask())
    # Independent unpacking of a few ids: bit (id % 32) of word (id // 32).
    for t in [0, 31, 32, 1000, vocab - 1] + tok.encode("42beta", add_special_tokens=False):
        bit = (int(bitmask[0, t // 32]) >> (t % 32)) & 1
        assert bool(bit) == bool(allowed[0, t])
    logits = torch.randn(3, vocab)
    via_xgr = logits.clone()
    apply_bitmask(via_xgr, bitmask)
    assert torch.equal(via_xgr, logits.masked_fill(~allowed, float("-inf")))


def toy_model(context: list[int], vocab: int) -> torch.Tensor:
    return torch.randn(vocab, generator=make_generator(hash(tuple(context)) % (2**31))) * 3


def test_spec_decode_with_grammar_matches_plain_greedy(compiler, tok, vocab) -> None:
    eos = tok.eos_token_id
    params_so = StructuredOutputParams(regex=r"([a-z]{2,4}[0-9]{2}-){6}end")
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    sampler, steps, k = Sampler(), 16, 3

    def batch(out, mask=None) -> SamplingBatch:
        return SamplingBatch.build(greedy, [out], [[1]], [None], vocab, "cpu", allowed_token_mask=mask)

    state, plain = compiler.new_state(params_so), []
    while len(plain) < steps and not state.is_terminated():
        token = sampler(toy_model([1] + plain, vocab)[None], batch(plain, compiler.allowed_mask([state])))
        assert state.accept_token(token.sampled_token_ids.item())
        plain.append(token.sampled_token_ids.item())

    state, spec, rounds = compiler.new_state(params_so), [], 0
    while len(spec) < len(plain):
        truth = plain[len(spec) : len(spec) + k]
        drafts = [t if (i + rounds) % 3 else (t + 7) % vocab for i, t in enumerate(truth)]  # some wrong
        bitmask = torch.full((k + 1, (vocab + 31) // 32), -1, dtype=torch.int32)
        state.fill_draft_bitmask(drafts, bitmask)
        mask = bitmask_to_bool(bitmask, vocab)[None]
        logits = torch.stack([toy_model([1] + spec + drafts[:j], vocab) for j in range(k + 1)])[None]
        padded = torch.tensor([drafts + [0] * (k - len(drafts))])
        emitted = rejection_sample(logits, padded, [len(drafts)], batch(spec), allowed_token_mask=mask)[0]
        if eos in emitted:  # the engine cuts the output at the stop token
            emitted = emitted[: emitted.index(eos) + 1]
        assert state.accept_tokens(emitted) == len(emitted)
        spec.extend(emitted)
        rounds += 1
    assert spec[: len(plain)] == plain
    assert rounds < len(plain)  # some drafts were accepted
