"""One request's position in its grammar (an xgrammar matcher), and the packed token bitmask:
int32 words, 32 tokens each, bit set = allowed, spanning the model's vocab."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr
from torch import Tensor

if TYPE_CHECKING:
    from .structured import Grammar


class GrammarState:
    """One request's position in its grammar. Not thread-safe; one per request (n > 1
    completions each need their own). `spent_s`: CPU time in its matcher (accepts, single-row
    fills; the calling thread's clock, so a busy host is not counted against it) since the last
    `take_spent`; `step_costs`: the last cost_window steps' costs, for whoever budgets them
    (engine/structured_state.py)."""

    def __init__(self, grammar: Grammar, stop_token_ids: Sequence[int] | None = None, cost_window: int = 3) -> None:
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(
            grammar.compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None
        )
        self.vocab_size = grammar.compiled.tokenizer_info.vocab_size
        self.num_accepted = 0  # tokens accepted so far (the rollback horizon)
        self.spent_s = 0.0
        self.step_costs: deque[float] = deque(maxlen=cost_window)

    def take_spent(self) -> float:
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        t0 = time.thread_time()
        ok = self.matcher.accept_token(int(token_id))
        self.spent_s += time.thread_time() - t0
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept a prefix of token_ids; returns how many were accepted before a rejection. A
        one-off (a resumed request's history), not a step's work: not counted in spent_s."""
        spent = self.spent_s
        try:
            for i, t in enumerate(token_ids):
                if not self.accept_token(t):
                    return i
            return len(token_ids)
        finally:
            self.spent_s = spent

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
        t0 = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.spent_s += time.thread_time() - t0

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
