"""A torch-free stand-in for the engine and its tokenizer (model name "toy"), for tests and smoke
runs: not a served model.

ToyEngine satisfies the engine port (moebus.engine.port.EnginePort: add_request with n > 1
fanned out into choices, abort_request, step, stats, close; no KV connector) and ToyTokenizer the
tokenizer's encode/decode/apply_chat_template/detokenizer, so the whole service stack can run
and be tested in milliseconds without weights. Byte-level vocabulary (id = byte + 3), so
multi-byte characters span tokens like in real BPE. It "generates" a fixed sentence, then EOS.
"""
from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOY_MODEL = "toy"
PAD, BOS, EOS = 0, 1, 2
_OFFSET = 3
TOY_REPLY = "Hello from the toy model. Ünïcode: 日本語 ok! The end."
TOY_JSON = '{"toy": true}'


class ToyTokenizer:
    eos_token_ids = [EOS]
    all_special_ids = [PAD, BOS, EOS]
    vocab_size = 256 + _OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + _OFFSET for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode(errors="replace")

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template  # jinja text that replaces the toy's own format

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: object) -> str:
        """kwargs (chat_template_kwargs, reasoning_effort) reach a template file, as in the real tokenizer."""
        if self.chat_template is not None:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
            return env.from_string(self.chat_template).render(messages=messages, tools=tools,
                                                              add_generation_prompt=add_generation_prompt, **kwargs)
        text = f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""
        text += "".join(f"<|{m['role']}|>\n{m.get('content') or ''}{json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}"
                        f"\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def detokenizer(self, prompt_ids: list[int]) -> ToyDetokenizer:
        return ToyDetokenizer(self)


class ToyDetokenizer:
    def __init__(self, tok: ToyTokenizer) -> None:
        self._tok, self._ids, self._emitted = tok, [], 0

    def push(self, new_ids: list[int]) -> str:
        self._ids += new_ids
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return ""
        delta, self._emitted = text[self._emitted:], len(text)
        return delta


@dataclass
class ToyEngineConfig:
    step_delay_s: float = 0.005  # simulated forward pass time per step
    max_num_seqs: int = 8
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 2048
    reply: str = TOY_REPLY  # what it "generates" (without an output constraint)


@dataclass
class _Req:
    request_id: str  # the engine's: "<group>#<index>" for a choice of an n > 1 request
    prompt: list[int]
    params: Any
    reply: list[int]
    group: str = ""  # the caller's request id
    index: int = 0
    out: list[int] = field(default_factory=list)
    blocks: int = 0


@dataclass
class ToyOutput:
    """Satisfies moebus.engine.port.EngineOutput (no text: the frontend detokenizes)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    new_text: str | None = None
    error: str | None = None
    retryable: bool = False
    error_param: str | None = None


class ToyEngine:
    """Satisfies moebus.engine.port.EnginePort."""

    lockstep = False
    kv = None  # no paged KV to move: workers run it aggregated only
    tokenizer: ToyTokenizer
    failed_steps_in_a_row: int

    def __init__(self, cfg: ToyEngineConfig | None = None) -> None:
        self.cfg = cfg or ToyEngineConfig()
        self.tokenizer = ToyTokenizer()
        self.failed_steps_in_a_row = 0  # its steps never fail with nobody to blame
        self._waiting: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._groups: dict[str, int] = {}  # caller's request id -> live choices
        self._free = self.cfg.num_blocks

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, priority: int = 0,
                    resume: Mapping[int, Sequence[int]] | None = None, images: Sequence[Any] = (),
                    owner: str = "", block_hashes: Any = None) -> None:
        """params: anything with the sampling fields it reads (n, max_tokens, logprobs, structured);
        resume: choice -> tokens it produced elsewhere (its reply goes on from there)."""
        if images:
            raise ValueError(f"{TOY_MODEL} cannot take images")
        if request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id}")
        if len(prompt_token_ids) >= self.cfg.max_model_len:  # the same check (and error type) as the engine
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.cfg.max_model_len}")
        structured = getattr(params, "structured", None)
        reply = self.tokenizer.encode(TOY_JSON if structured is not None else self.cfg.reply)
        n = getattr(params, "n", 1) or 1
        prior = {k: [] for k in range(n)} if resume is None else {k: list(t) for k, t in resume.items()}
        if not prior or not all(0 <= k < n for k in prior):
            raise ValueError(f"resume must name choices of 0..{n - 1}")
        for k, out in sorted(prior.items()):  # its reply is fixed: every choice (whatever its seed) is the same
            rid = request_id if n == 1 else f"{request_id}#{k}"
            self._waiting.append(_Req(rid, list(prompt_token_ids), params, reply, request_id, k, out))
        self._groups[request_id] = len(prior)

    def prepare(self, params: Any) -> None:
        """Nothing to compile: the toy's structured reply is fixed."""
        return None

    def abort_request(self, request_id: str) -> bool:
        """Every live choice of the request; False: none was live."""
        live = self._groups.pop(request_id, 0)
        for rid in [r for r, q in self._running.items() if q.group == request_id]:
            self._free += self._running.pop(rid).blocks
        self._waiting = deque(r for r in self._waiting if r.group != request_id)
        return live > 0

    def _finished(self, req: _Req) -> None:
        self._free += self._running.pop(req.request_id).blocks
        self._groups[req.group] -= 1
        if not self._groups[req.group]:
            del self._groups[req.group]

    def close(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self._running), "num_waiting": len(self._waiting),
                "kv_blocks_free": self._free, "kv_blocks_total": self.cfg.num_blocks}

    def _blocks(self, req: _Req) -> int:
        return math.ceil((len(req.prompt) + len(req.reply) + 1) / self.cfg.block_size)

    def step(self) -> list[ToyOutput]:
        while self._waiting and len(self._running) < self.cfg.max_num_seqs:
            need = self._blocks(self._waiting[0])
            if need > self._free:
                break
            req = self._waiting.popleft()
            req.blocks, self._free = need, self._free - need
            self._running[req.request_id] = req
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)
        outputs = []
        for req in list(self._running.values()):
            pos = len(req.out)
            token = req.reply[pos] if pos < len(req.reply) else EOS
            req.out.append(token)
            max_tokens = req.params.max_tokens
            reason = "stop" if token == EOS else "length" if max_tokens and len(req.out) >= max_tokens else None
            lp = None
            if req.params.logprobs is not None:
                lp = [{token: -0.25, **{t: -1.0 - k for k, t in enumerate(range(3, 3 + req.params.logprobs))
                                        if t != token}}]
            outputs.append(ToyOutput(req.group, [token], reason is not None, reason, len(req.prompt), 0, lp,
                                     index=req.index))
            if reason is not None:
                self._finished(req)
        return outputs
