"""Structured outputs (json_schema, json_object, regex, choice, grammar) on xgrammar.

`StructuredOutputCompiler` turns StructuredOutputParams into a compiled `Grammar` (cached);
each request owns a `GrammarState` (xgrammar matcher) that is advanced with accepted tokens and
fills its row of the packed token bitmask (int32, 32 tokens per word, bit set = allowed).
The bitmask spans the MODEL's vocab: ids past the tokenizer's vocab (lm_head padding) are
never allowed.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
import torch
import xgrammar as xgr
from torch import Tensor
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .params import StructuredOutputParams


@dataclass(slots=True)
class StructuredOutputConfig:
    any_whitespace: bool = True  # json: allow any whitespace between elements
    max_whitespace_cnt: int | None = None  # json: cap a whitespace run (stops endless "\n\n")
    strict_mode: bool = True  # json_schema: no properties/items beyond the schema
    max_threads: int = 8  # xgrammar compile + batched bitmask threads
    cache_size: int = 256  # compiled grammars kept (LRU)

    def __post_init__(self) -> None:
        if self.max_whitespace_cnt is not None and self.max_whitespace_cnt < 1:
            raise ValueError("max_whitespace_cnt must be >= 1 or None")
        if self.max_threads < 1 or self.cache_size < 0:
            raise ValueError("max_threads must be >= 1 and cache_size >= 0")


@dataclass(frozen=True, slots=True)
class Grammar:
    kind: str  # json_schema | json_object | regex | choice | grammar
    compiled: xgr.CompiledGrammar


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(err: Exception) -> str:
    """xgrammar errors start with '[time] file.cc:line: '; keep only the message."""
    return _XGR_PREFIX.sub("", str(err).strip()).splitlines()[0]


def choice_ebnf(choices: Sequence[str]) -> str:
    """EBNF alternative of the literal choices. xgrammar EBNF string literals accept JSON's
    escapes (\\" \\\\ \\n \\uXXXX), so json.dumps quotes each choice safely."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputCompiler:
    """Compiles and caches grammars for one tokenizer and model vocab size."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer,
        vocab_size: int | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        config: StructuredOutputConfig | None = None,
    ) -> None:
        """vocab_size: the model's logits dim (may exceed the tokenizer's vocab; padding is
        masked). stop_token_ids: tokens that end a completed grammar; default the tokenizer's
        eos (a bare tokenizers.Tokenizer has none, so pass them)."""
        if isinstance(tokenizer, tokenizers.Tokenizer):
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        self.config = config or StructuredOutputConfig()
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
        )
        self.vocab_size = self.tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self.config.max_threads)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self.config.max_threads)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()  # the API layer may compile from worker threads

    def compile(self, params: StructuredOutputParams) -> Grammar:
        """Raises ValueError for an invalid schema / regex (the API maps it to HTTP 400)."""
        kind, source = self._key(params)
        key = (kind, source)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(kind, source)
        except RuntimeError as e:  # xgrammar reports every parse / conversion error this way
            raise ValueError(f"invalid {kind}: {_clean(e)}") from e
        grammar = Grammar(kind=kind, compiled=compiled)
        if self.config.cache_size:
            with self._lock:
                self._cache[key] = grammar
                if len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return grammar

    def new_state(
        self, params: StructuredOutputParams, stop_token_ids: Sequence[int] | None = None
    ) -> GrammarState:
        return GrammarState(self.compile(params), stop_token_ids)

    def fill_bitmask(
        self, states: Sequence[GrammarState | None], bitmask: Tensor | None = None
    ) -> Tensor:
        """Packed `[B, ceil(V/32)]` int32 CPU bitmask for a batch; rows without a grammar (None)
        or with a terminated one are all-allowed. Filled by xgrammar's threaded batch call."""
        if bitmask is None:
            bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        else:
            xgr.reset_token_bitmask(bitmask)
        rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated()]
        if rows:
            matchers = [states[i].matcher for i in rows]
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask

    def allowed_mask(
        self, states: Sequence[GrammarState | None], device: torch.device | str = "cpu"
    ) -> Tensor | None:
        """`[B, V]` bool mask on `device` for SamplingBatch.build, or None when no row is
        structured. The packed bitmask (32x smaller) is what crosses to the device."""
        if all(s is None for s in states):
            return None
        return bitmask_to_bool(self.fill_bitmask(states).to(device, non_blocking=True), self.vocab_size)

    def _key(self, params: StructuredOutputParams) -> tuple[str, str]:
        if params.json_schema is not None:
            schema = params.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid json_schema: not valid JSON ({e})") from e
            if not isinstance(schema, dict | bool):
                raise ValueError("invalid json_schema: must be a JSON object")
            # Re-dumped (whitespace-normalized) but NOT key-sorted: property order is the
            # order xgrammar generates them in, so it is part of the grammar.
            return "json_schema", json.dumps(schema)
        if params.json_object:
            return "json_object", ""
        if params.regex is not None:
            return "regex", params.regex
        if params.grammar is not None:
            return "grammar", params.grammar
        return "choice", choice_ebnf(params.choice)

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            cfg = self.config
            return self._compiler.compile_json_schema(
                source,
                any_whitespace=cfg.any_whitespace,
                strict_mode=cfg.strict_mode,
                max_whitespace_cnt=cfg.max_whitespace_cnt,
            )
        if kind == "json_object":
            # A JSON object (OpenAI's json_object mode): the top level is {...}, closed before the
            # stop token is allowed. xgrammar's builtin grammar would also take a bare array.
            cfg = self.config
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=cfg.any_whitespace,
                                                      strict_mode=False, max_whitespace_cnt=cfg.max_whitespace_cnt)
        if kind == "regex":
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(source)  # choice (as EBNF) and grammar


class GrammarState:
    """One request's position in its grammar. Not thread-safe; one per request (n > 1
    completions each need their own)."""

    def __init__(self, grammar: Grammar, stop_token_ids: Sequence[int] | None = None) -> None:
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(
            grammar.compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None
        )
        self.vocab_size = grammar.compiled.tokenizer_info.vocab_size
        self.num_accepted = 0  # tokens accepted so far (the rollback horizon)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        ok = self.matcher.accept_token(int(token_id))
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept a prefix of token_ids; returns how many were accepted before a rejection."""
        for i, t in enumerate(token_ids):
            if not self.accept_token(t):
                return i
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after the grammar completed."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token is now allowed)."""
        return self.matcher.is_completed()

    def fill_bitmask(self, bitmask: Tensor, row: int = 0) -> None:
        """Write this state's allowed tokens into row `row` of a packed int32 CPU bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_mask(self) -> Tensor:
        """`[V]` bool mask of the tokens allowed next."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask)
        return bitmask_to_bool(bitmask, self.vocab_size)[0]

    def fill_draft_bitmask(self, draft_token_ids: Sequence[int], bitmask: Tensor, start_row: int = 0) -> None:
        """Rows start_row .. start_row+len(draft): the mask before each draft token and after
        the last (bonus position), for `rejection_sample`'s per-position allowed mask. The
        state is restored afterwards. Positions past a draft the grammar rejects are left
        all-allowed: verification stops at that draft anyway."""
        bitmask[start_row : start_row + len(draft_token_ids) + 1] = -1  # all bits set: allowed
        accepted = 0
        for j in range(len(draft_token_ids) + 1):
            if self.is_terminated():
                break
            self.fill_bitmask(bitmask, start_row + j)
            if j == len(draft_token_ids) or not self.accept_token(draft_token_ids[j]):
                break
            accepted += 1
        self.rollback(accepted)


def bitmask_to_bool(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Unpack `[B, W]` int32 words (bit i of word w = token 32*w + i) into `[B, V]` bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: Tensor, bitmask: Tensor, indices: Sequence[int] | None = None) -> None:
    """In place: disallowed tokens -> -inf, via xgrammar's kernel (CPU, or Triton on CUDA).
    The bitmask is moved to the logits' device first."""
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1],
        indices=list(indices) if indices is not None else None,
    )
