"""Engine RequestOutput -> wire TokenChunk (text, logprobs with token strings); a step's chunks
grouped per frontend (StepChunks)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from moebus.engine.port import EngineOutput
from moebus.shared.messages import GenerateRequest, TokenChunk, TokenChunks, TokenLogprob, TopLogprob


def chunk_from_output(out: EngineOutput, req: GenerateRequest, worker_id: str, index: int, seq: int,
                      tok: Any) -> TokenChunk:
    logprobs = None
    if out.logprobs is not None and req.params.logprobs is not None:
        logprobs = [_logprob(t, lp, req.params.logprobs, tok) for t, lp in zip(out.new_token_ids, out.logprobs,
                                                                              strict=False)]
    return TokenChunk(
        request_id=req.request_id, worker_id=worker_id, attempt=req.attempt, index=index, seq=seq,
        token_ids=list(out.new_token_ids), text=out.new_text, logprobs=logprobs,
        finished=bool(out.finished), finish_reason=out.finish_reason if out.finished else None,
        num_prompt_tokens=int(out.num_prompt_tokens or 0), num_cached_tokens=int(out.num_cached_tokens or 0),
        stop_reason=getattr(out, "stop_reason", None) if out.finished else None,  # engines without it: None
    )


def _logprob(token_id: int, by_id: dict[int, float], top_n: int, tok: Any) -> TokenLogprob:
    ranked = sorted(by_id.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
    chosen = by_id.get(token_id, ranked[0][1] if ranked else 0.0)
    return TokenLogprob(token_id=token_id, token=_text(tok, token_id), logprob=float(chosen),
                        top=[TopLogprob(token_id=t, token=_text(tok, t), logprob=float(lp)) for t, lp in ranked])


def _text(tok: Any, token_id: int) -> str:
    try:
        return tok.decode([token_id], skip_special_tokens=False)
    except TypeError:  # tokenizers without the keyword (the toy one)
        return tok.decode([token_id])


class StepChunks:
    """One engine step's encoded chunks grouped by frontend, as TokenChunks messages of at most
    about max_bytes each (long logprob lists stay well under the server's max payload)."""

    def __init__(self, max_bytes: int = 256 * 1024) -> None:
        self.max_bytes = max_bytes
        self._groups: dict[str, list[list[bytes]]] = {}
        self._size: dict[str, int] = {}  # of each frontend's last group

    def add(self, frontend: str, data: bytes) -> None:
        groups = self._groups.setdefault(frontend, [[]])
        if groups[-1] and self._size[frontend] + len(data) > self.max_bytes:
            groups.append([])
            self._size[frontend] = 0
        groups[-1].append(data)
        self._size[frontend] = self._size.get(frontend, 0) + len(data)

    def messages(self) -> Iterator[tuple[str, bytes]]:
        """(frontend id, encoded TokenChunks), in the order the chunks came."""
        for frontend, groups in self._groups.items():
            for group in groups:
                yield frontend, TokenChunks.join(group)
