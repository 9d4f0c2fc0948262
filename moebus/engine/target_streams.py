"""The target model's last hidden states per request, kept for a drafter that consumes them (MTP).

A forward hook on the module whose input is the wanted hidden state (DeepSeek-V4: `hc_head`, whose
input is the mHC streams) captures every step's rows. After the step, `record` keeps, per
request, the rows of the positions whose input token is now known to be right (a verified step's
first token and its accepted drafts; every prefill row), the last `window` of them. `windows`
hands them to the proposer as one tensor, right-aligned at each request's last computed position.
A request whose history has a gap (a prefix-cache hit skipped rows, or it was preempted and
recomputes) starts over from the rows it next computes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moebus.engine.model_runner import StepResult
from moebus.engine.scheduler import SchedulerOutput

MISSING = float("nan")  # fill of window rows with no history (the proposer tests for it)


class TargetStreams:
    def __init__(self, module: nn.Module, window: int) -> None:
        self.window = window
        self._rows: torch.Tensor | None = None  # the last forward's captured input, [T, ...]
        self._hist: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (end position, rows)
        self._hook = module.register_forward_hook(self._capture)

    def _capture(self, _module: nn.Module, args: tuple, _out: object) -> None:
        self._rows = args[0]

    def record(self, sched: SchedulerOutput, result: StepResult) -> None:
        rows, self._rows = self._rows, None
        if rows is None:
            return
        off = 0
        for s, n_acc in zip(sched.scheduled, result.num_accepted_drafts, strict=True):
            rid = s.request.request_id
            valid = s.num_tokens - s.num_draft + n_acc if s.num_draft else s.num_tokens
            new = rows[off: off + valid]
            off += s.num_tokens
            if s.request.status.finished:  # aborted while the step ran: already forgotten
                continue
            end, old = self._hist.get(rid, (-1, None))
            if old is not None and end == s.start:
                new = torch.cat([old, new])
            self._hist[rid] = (s.start + valid, new[-self.window:].clone())

    def windows(self, request_ids: Sequence[str], num_tokens: Sequence[int]) -> torch.Tensor | None:
        """[B, window, ...]: row window-1 is position num_tokens[b]-2 (the last one computed), earlier
        rows go back from there; rows with no history are MISSING. None when nothing is kept."""
        found = [self._hist.get(rid) for rid in request_ids]
        sample = next((h[1] for h in found if h is not None), None)
        if sample is None:
            return None
        out = sample.new_full((len(request_ids), self.window, *sample.shape[1:]), MISSING)
        for b, (h, n) in enumerate(zip(found, num_tokens, strict=True)):
            if h is not None and h[0] == n - 1:
                out[b, self.window - len(h[1]):] = h[1]
        return out

    def forget(self, request_id: str) -> None:
        self._hist.pop(request_id, None)

    def close(self) -> None:
        self._hook.remove()
