"""Structured outputs (json_schema, json_object, regex, choice, grammar) on xgrammar.

`StructuredOutputCompiler` turns StructuredOutputParams into a compiled `Grammar` (cached, and
so are refusals); `compile` runs on the caller's thread, `compile_async` in a child process under
a deadline (compile_pool.py). Each request owns a `GrammarState` (grammar_state.py) that is
advanced with accepted tokens and fills its row of the packed token bitmask; it times its own
matcher calls, so a grammar too costly to follow can be told apart (engine/structured_state.py).
The bitmask spans the MODEL's vocab: ids past the tokenizer's vocab (lm_head padding) are never
allowed.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import tokenizers
import torch
import xgrammar as xgr
from torch import Tensor
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from moebus.engine.port import RequestRefused

from .compile_child import CompileJob, compile_job
from .compile_pool import CompileFailed, CompilePool, CompilerBusy, CompileTimeout
from .grammar_state import GrammarState, bitmask_to_bool
from .params import StructuredOutputParams


@dataclass(slots=True)
class StructuredOutputConfig:
    any_whitespace: bool = True  # json: allow any whitespace between elements
    max_whitespace_cnt: int | None = None  # json: cap a whitespace run (stops endless "\n\n")
    strict_mode: bool = True  # json_schema: no properties/items beyond the schema
    max_threads: int = 8  # xgrammar compile + batched bitmask threads
    cache_size: int = 256  # compiled grammars kept (LRU), and as many refused ones
    # compile_async: the deadline of one compile (CPU seconds of its child, compile_pool.py), the
    # child processes compiling, how many compiles may wait for one (more: refused, retryable), and
    # how long a refusal is remembered
    compile_timeout_s: float = 3.0
    compile_procs: int = 1
    max_pending_compiles: int = 8
    refusal_ttl_s: float = 600.0
    # What following a grammar may cost (the engine fails a request past it, structured_state.py):
    # on average over its last mask_window steps, matcher CPU time a step (token mask + accepts).
    mask_budget_s: float = 0.05
    mask_window: int = 3

    def __post_init__(self) -> None:
        if self.max_whitespace_cnt is not None and self.max_whitespace_cnt < 1:
            raise ValueError("max_whitespace_cnt must be >= 1 or None")
        if self.max_threads < 1 or self.cache_size < 0:
            raise ValueError("max_threads must be >= 1 and cache_size >= 0")
        if self.compile_timeout_s <= 0 or self.mask_budget_s <= 0 or self.mask_window < 1:
            raise ValueError("compile_timeout_s and mask_budget_s must be > 0, mask_window >= 1")


@dataclass(frozen=True, slots=True)
class Grammar:
    kind: str  # json_schema | json_object | regex | choice | grammar
    compiled: xgr.CompiledGrammar

    @property
    def noun(self) -> str:
        """The kind as error messages name it."""
        return _NOUN[self.kind]


_NOUN = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choices", "grammar": "grammar"}
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(err: Exception) -> str:
    """xgrammar errors start with '[time] file.cc:line: '; keep only the message."""
    return _XGR_PREFIX.sub("", str(err).strip()).splitlines()[0]


def _busy(e: CompilerBusy) -> RequestRefused:
    return RequestRefused(f"the grammar compiler is busy ({e}): try again", retryable=True)


def choice_ebnf(choices: Sequence[str]) -> str:
    """EBNF alternative of the literal choices. xgrammar EBNF string literals accept JSON's
    escapes (\\" \\\\ \\n \\uXXXX), so json.dumps quotes each choice safely."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A constraint that failed to compile (invalid, or past the deadline), remembered a while."""

    message: str
    at: float


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
        self._cache: OrderedDict[tuple[str, str], Grammar | _Refusal] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future[Grammar]] = {}  # compile_async's, one per key
        self._pool: CompilePool | None = None  # started on the first compile_async
        self._lock = threading.Lock()  # compile_async finishes on the pool's threads

    def compile(self, params: StructuredOutputParams) -> Grammar:
        """On this thread. Raises RequestRefused (a ValueError) for an invalid schema / regex (the
        API maps it to HTTP 400), or one refused before (compile_async's deadline)."""
        key = self._key(params)
        if (hit := self._lookup(key)) is not None:
            return hit
        try:
            compiled = compile_job(self._compiler, self._job(*key))
        except RuntimeError as e:  # xgrammar reports every parse / conversion error this way
            raise self._refuse(key, f"invalid {key[0]}: {_clean(e)}") from e
        return self._remember(key, Grammar(kind=key[0], compiled=compiled))

    def compile_async(self, params: StructuredOutputParams) -> Future[Grammar]:
        """compile() in a child process under config.compile_timeout_s (a cached grammar or
        refusal: a settled future). The future raises RequestRefused: invalid, past the deadline,
        or (retryable) too many compiles waiting."""
        fut: Future[Grammar] = Future()
        try:
            key = self._key(params)
            if (hit := self._lookup(key)) is not None:
                fut.set_result(hit)
                return fut
        except RequestRefused as e:
            fut.set_exception(e)
            return fut
        with self._lock:
            if (running := self._compiling.get(key)) is not None:
                return running
            self._compiling[key] = fut
            if self._pool is None:
                cfg = self.config
                self._pool = CompilePool(self.tokenizer_info.serialize_json(), timeout_s=cfg.compile_timeout_s,
                                         procs=cfg.compile_procs, max_pending=cfg.max_pending_compiles)
        try:
            job = self._pool.submit(self._job(*key))
        except CompilerBusy as e:
            self._settle(key, fut, _busy(e))
        else:
            job.add_done_callback(lambda j: self._finish(key, fut, j))
        return fut

    def _finish(self, key: tuple[str, str], fut: Future[Grammar], job: Future[str]) -> None:
        kind = key[0]
        try:
            grammar = Grammar(kind, xgr.CompiledGrammar.deserialize_json(job.result(), self.tokenizer_info))
        except CompileTimeout:
            self._settle(key, fut, self._refuse(key, f"compiling the {_NOUN[kind]} took longer than "
                                                     f"{self.config.compile_timeout_s:g}s"))
        except CompilerBusy as e:  # not the grammar's fault: not remembered
            self._settle(key, fut, _busy(e))
        except CompileFailed as e:
            self._settle(key, fut, self._refuse(key, f"invalid {kind}: {_clean(e)}"))
        except Exception as e:  # a fault of ours, not the request's: not remembered
            self._settle(key, fut, e)
        else:
            self._settle(key, fut, self._remember(key, grammar))

    def _settle(self, key: tuple[str, str], fut: Future[Grammar], result: Grammar | Exception) -> None:
        with self._lock:
            self._compiling.pop(key, None)
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def _refuse(self, key: tuple[str, str], message: str) -> RequestRefused:
        self._remember(key, _Refusal(message, time.monotonic()))
        return RequestRefused(message)

    def _lookup(self, key: tuple[str, str]) -> Grammar | None:
        """The cached grammar, None when unknown; raises RequestRefused when refused lately."""
        with self._lock:
            hit = self._cache.get(key)
            if isinstance(hit, _Refusal) and time.monotonic() - hit.at > self.config.refusal_ttl_s:
                del self._cache[key]  # compile times vary with load: try it again
                return None
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, _Refusal):
            raise RequestRefused(hit.message)
        return hit

    def _remember(self, key: tuple[str, str], value: Grammar | _Refusal) -> Grammar | _Refusal:
        if self.config.cache_size:
            with self._lock:
                self._cache[key] = value
                if len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return value

    def new_state(
        self, params: StructuredOutputParams, stop_token_ids: Sequence[int] | None = None
    ) -> GrammarState:
        return GrammarState(self.compile(params), stop_token_ids, cost_window=self.config.mask_window)

    def fill_bitmask(
        self, states: Sequence[GrammarState | None], bitmask: Tensor | None = None, itemized: bool = False
    ) -> Tensor:
        """Packed `[B, ceil(V/32)]` int32 CPU bitmask for a batch; rows without a grammar (None)
        or with a terminated one are all-allowed. Filled by xgrammar's threaded batch call, or
        itemized: row by row, each state timing its own (GrammarState.spent_s)."""
        if bitmask is None:
            bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        else:
            xgr.reset_token_bitmask(bitmask)
        rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated()]
        if itemized:
            for i in rows:
                states[i].fill_bitmask(bitmask, i)
        elif rows:
            matchers = [states[i].matcher for i in rows]
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask

    def allowed_mask(
        self, states: Sequence[GrammarState | None], device: torch.device | str = "cpu", itemized: bool = False
    ) -> Tensor | None:
        """`[B, V]` bool mask on `device` for SamplingBatch.build, or None when no row is
        structured. The packed bitmask (32x smaller) is what crosses to the device."""
        if all(s is None for s in states):
            return None
        mask = self.fill_bitmask(states, itemized=itemized)
        return bitmask_to_bool(mask.to(device, non_blocking=True), self.vocab_size)

    def close(self) -> None:
        """Stops the compile children."""
        if self._pool is not None:
            self._pool.close()

    def _key(self, params: StructuredOutputParams) -> tuple[str, str]:
        if params.json_schema is not None:
            schema = params.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise RequestRefused(f"invalid json_schema: not valid JSON ({e})") from e
            if not isinstance(schema, dict | bool):
                raise RequestRefused("invalid json_schema: must be a JSON object")
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

    def _job(self, kind: str, source: str) -> CompileJob:
        cfg = self.config
        json_opts = {"any_whitespace": cfg.any_whitespace, "max_whitespace_cnt": cfg.max_whitespace_cnt}
        if kind == "json_schema":
            return CompileJob("json_schema", source, {**json_opts, "strict_mode": cfg.strict_mode})
        if kind == "json_object":
            # A JSON object (OpenAI's json_object mode): the top level is {...}, closed before the
            # stop token is allowed. xgrammar's builtin grammar would also take a bare array.
            return CompileJob("json_schema", '{"type": "object"}', {**json_opts, "strict_mode": False})
        return CompileJob("regex" if kind == "regex" else "grammar", source)  # choice arrives as EBNF
