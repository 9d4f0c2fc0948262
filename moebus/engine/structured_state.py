"""Engine-side glue for structured outputs: one lazily built grammar compiler per engine, the
compiles done before a request is admitted (`prepare`, off the engine thread, under a deadline),
and the budget of what following a grammar may cost each step.

The budget: a request's matcher CPU time each step (its token mask and its accepted tokens) may
average `mask_budget_s` over its last `mask_window` steps; past that it is failed alone, a 400
naming its field, and the batch goes on without it. CPU time, not the clock: a host busy with
other work does not make a grammar costly. Masks are filled by xgrammar's threaded batch call,
which does not say whose row cost what: a batch (by the clock) or an accept over the budget makes
the next `mask_window` steps fill row by row, each row timed, so the request to blame is found.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from moebus.engine.port import RequestRefused
from moebus.engine.sampling import StructuredOutputParams

if TYPE_CHECKING:
    from moebus.engine.request import Request
    from moebus.engine.sampling.grammar_state import GrammarState
    from moebus.engine.sampling.structured import StructuredOutputCompiler, StructuredOutputConfig
    from moebus.text.tokenizer import Tokenizer


class GrammarHub:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: StructuredOutputConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._config = config
        self._compiler: StructuredOutputCompiler | None = None
        self._itemize = 0  # steps left to fill masks row by row
        self._over: dict[str, tuple[str, str]] = {}  # request id -> (error, param): past the budget

    @property
    def compiler(self) -> StructuredOutputCompiler:
        if self._compiler is None:  # building the token trie walks the vocabulary: only when first needed
            from moebus.engine.sampling.structured import StructuredOutputCompiler

            self._compiler = StructuredOutputCompiler(self.tokenizer.backend, self.vocab_size,
                                                      stop_token_ids=self.tokenizer.eos_token_ids,
                                                      config=self._config)
        return self._compiler

    def prepare(self, params: StructuredOutputParams) -> Future[None] | None:
        """The grammar compiled in a child process (compile_pool.py), so that state_for finds it
        cached: None when it already is; else a future raising RequestRefused naming the field."""
        compiled = self.compiler.compile_async(params)
        if compiled.done() and compiled.exception() is None:
            return None
        ready: Future[None] = Future()
        compiled.add_done_callback(lambda f: _settle(ready, f, _param(params)))
        return ready

    def state_for(self, params: StructuredOutputParams) -> GrammarState:
        """Raises RequestRefused (a ValueError) on an invalid schema/regex, before the request is
        admitted. Compiles here when `prepare` did not (an offline engine)."""
        try:
            return self.compiler.new_state(params)
        except ValueError as e:
            raise RequestRefused(str(e), param=_param(params)) from e

    def batch_mask(self, reqs: list[Request]) -> torch.Tensor | None:
        if self._compiler is None or all(r.grammar is None for r in reqs):
            return None
        cfg = self._compiler.config
        exact = self._itemize > 0 or sum(r.grammar is not None for r in reqs) == 1
        t0 = time.perf_counter()
        mask = self._compiler.allowed_mask([r.grammar for r in reqs], itemized=exact)
        slow = time.perf_counter() - t0 > cfg.mask_budget_s
        for r in reqs:
            if r.grammar is None:
                continue
            spent = r.grammar.take_spent()  # its accepts since its last mask, and this mask if exact
            slow |= spent > cfg.mask_budget_s
            if exact:
                r.grammar.step_costs.append(spent)
                if sum(r.grammar.step_costs) > cfg.mask_budget_s * cfg.mask_window:
                    self._over.setdefault(r.request_id, self._verdict(r, cfg))
        self._itemize = cfg.mask_window if slow else max(0, self._itemize - 1)
        return mask

    def take_over_budget(self) -> dict[str, tuple[str, str]]:
        """Requests whose grammar cost past the budget since the last call: id -> (error, param)."""
        over, self._over = self._over, {}
        return over

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    @staticmethod
    def _verdict(r: Request, cfg: StructuredOutputConfig) -> tuple[str, str]:
        costs = r.grammar.step_costs
        return (f"following the {r.grammar.grammar.noun} cost {1e3 * sum(costs) / len(costs):.0f} ms a step over its last "
                f"{len(costs)} steps, past the budget of {1e3 * cfg.mask_budget_s:.0f} ms: it is too ambiguous "
                "to serve", _param(r.params.structured))


def _param(params: StructuredOutputParams) -> str:
    """The request field the constraint came from (the frontend names it), else the engine's own."""
    return params.param or "structured"


def _settle(ready: Future[None], compiled: Future, param: str) -> None:
    e = compiled.exception()
    if e is None:
        ready.set_result(None)
    elif isinstance(e, RequestRefused):
        ready.set_exception(RequestRefused(str(e), param=param, retryable=e.retryable))
    else:
        ready.set_exception(e)
