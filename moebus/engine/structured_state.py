"""Engine-side glue for structured outputs: one lazily built grammar compiler per engine."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moebus.engine.sampling import StructuredOutputParams

if TYPE_CHECKING:
    from moebus.engine.request import Request
    from moebus.engine.sampling.structured import GrammarState, StructuredOutputCompiler
    from moebus.engine.tokenizer import Tokenizer


class GrammarHub:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: StructuredOutputCompiler | None = None

    @property
    def compiler(self) -> StructuredOutputCompiler:
        if self._compiler is None:  # building the token trie costs ~1 s: only when first needed
            from moebus.engine.sampling.structured import StructuredOutputCompiler

            self._compiler = StructuredOutputCompiler(self.tokenizer.backend, self.vocab_size,
                                                      stop_token_ids=self.tokenizer.eos_token_ids)
        return self._compiler

    def state_for(self, params: StructuredOutputParams) -> GrammarState:
        """Raises ValueError on an invalid schema/regex, before the request is admitted."""
        return self.compiler.new_state(params)

    def batch_mask(self, reqs: list[Request]) -> torch.Tensor | None:
        if self._compiler is None or all(r.grammar is None for r in reqs):
            return None
        return self._compiler.allowed_mask([r.grammar for r in reqs])
