"""Resuming a migrated request: its choices continue from the tokens they produced elsewhere.

The tokens become the choice's output so far, as if this engine had sampled them (a preempted
request's state): its prompt and those tokens are prefilled together and the next step samples
the token after them. Everything a step reads of a choice's past is rebuilt from the tokens:
max_tokens and min_tokens count them, penalties see them, the grammar has accepted them, and the
detokenizer and stop-string matcher have read them (the text they made was already sent, so it is
dropped; text held back at a partial character or a partial stop string stays held, as it would
have). A seeded choice's generator is advanced by one draw per token, exactly the draws the
sampler makes (sampling.sampler.advance_generator), so seeded sampling continues
token-identically, except after speculative decoding, whose rejection sampler draws differently.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from moebus.engine.request_table import Tracked
from moebus.engine.sampling.sampler import advance_generator


class ChoiceFinished(ValueError):
    """The resumed tokens had already ended the choice: nothing is left to generate."""


def check_resume(resume: Mapping[int, Sequence[int]] | None, n: int, vocab_size: int) -> dict[int, list[int]]:
    """The choices to run (index -> tokens so far); every one from scratch when resume is None."""
    if resume is None:
        return {k: [] for k in range(n)}
    if not resume:
        raise ValueError("resume names no choice to run")
    out = {}
    for k, toks in resume.items():
        if not 0 <= k < n:
            raise ValueError(f"resume names choice {k}; the request has n={n}")
        if any(not 0 <= t < vocab_size for t in toks):
            raise ValueError(f"resumed choice {k} has a token id out of the vocabulary")
        out[k] = list(toks)
    return out


def prime(tr: Tracked, tokens: list[int]) -> None:
    """Bring a new choice to the state it had after producing `tokens`; ChoiceFinished when those
    tokens had already ended it, ValueError when its grammar rejects them."""
    if not tokens:
        return
    req, params = tr.req, tr.req.params
    if len(tokens) >= req.max_tokens:
        raise ChoiceFinished(f"choice {tr.index} already has {len(tokens)} of its {req.max_tokens} tokens")
    req.output_token_ids = list(tokens)
    for i, t in enumerate(tokens):
        if i + 1 >= params.min_tokens and (t in req.eos_token_ids or t in params.stop_token_ids):
            raise ChoiceFinished(f"choice {tr.index} had already stopped at token {i}")
    if req.grammar is not None:
        if req.grammar.accept_tokens(tokens) != len(tokens):
            raise ValueError(f"choice {tr.index}: its grammar rejects the resumed tokens")
        if req.grammar.is_terminated():
            raise ChoiceFinished(f"choice {tr.index} had already completed its grammar")
    tr.stops.feed(tr.detok.push(list(tokens)))
    if tr.stops.stopped:
        raise ChoiceFinished(f"choice {tr.index} had already stopped at a stop string")
    if req.generator is not None and not params.greedy:
        advance_generator(req.generator, len(tokens))
