"""Drives the synchronous engine on one dedicated thread.

The asyncio side only enqueues commands (add/inject/abort/call/stop); the thread applies them
between steps, so the engine is never touched from two threads. Outputs go back to the event
loop with call_soon_threadsafe, with a stats snapshot taken on the engine thread.

The engine is anything satisfying moebus.engine.port.EnginePort (LLMEngine, an EP rank's
DPEngine, the toy engine). The worker's KV (`kv`, worker/kv_engine.py EngineKV) is attached to
the engine's KV connector when an engine is built; from then on the engine's scheduler and step
call the connector themselves (a prefix from the KV tier at admission, events and offload after
steps). This loop only times the P/D hand-off: extracting a prefill request's KV right after the
step that sampled its first token (then aborting it there, before the next step reuses blocks)
and injecting a request prefilled elsewhere.
Lockstep engines (an EP group's DPEngine) step every iteration, idle or not: the step is a
collective the other ranks wait in.

One request never stops the thread: the engine fails a request whose own state raises (its output
carries `error`), and an add the engine rejects becomes AddFailed. Work an add needs first that may
take long (engine.prepare: compiling its grammar, under a deadline) runs off the thread; the add
waits aside and is applied when that is done, or becomes AddFailed. If the engine itself breaks (an
exception out of step, or `max_failed_steps` steps in a row failing with nobody to blame), its
requests are reported lost (`on_fatal`), and the thread builds a new engine from the factory, up
to `max_restarts` times in a row (an engine that served `healthy_after_s` before it broke starts
the count again; not for lockstep engines: their group must restart together); only then does
the loop stay `failed`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from moebus.engine.port import EngineOutput, EnginePort, LockstepEngine, RequestRefused
from moebus.kv.hashing import BlockHashes
from moebus.shared.messages import ImageEmbedding

if TYPE_CHECKING:
    from .kv_engine import EngineKV

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AddFailed:
    """An add_request the engine rejected (e.g. prompt longer than max_model_len); param: the
    request field at fault, when the engine named it; retryable: refused for now only (busy)."""

    request_id: str
    error: str
    param: str | None = None
    retryable: bool = False

    @classmethod
    def of(cls, request_id: str, e: Exception) -> AddFailed:
        if isinstance(e, RequestRefused):
            return cls(request_id, str(e), e.param, e.retryable)
        return cls(request_id, _reason(e))


@dataclass(slots=True)
class Prefilled:
    """A prefill-only request reached its first token: its KV (None: extraction failed)."""

    request_id: str
    payload: Any
    extract_ns: tuple[int, int] = (0, 0)  # when the extraction ran (wall clock, ns): its span


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One engine step (wall clock, ns) and how many outputs it made: the spans of its requests."""

    started_ns: int
    ended_ns: int
    outputs: int


OnOutputs = Callable[[Sequence[EngineOutput], list[AddFailed], list[Prefilled], StepTiming], None]
_STOP = object()


class EngineLoop:
    def __init__(self, factory: Callable[[], EnginePort], loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
                 on_fatal: Callable[[BaseException], None], on_ready: Callable[[], None] = lambda: None,
                 kv: EngineKV | None = None, max_restarts: int = 3, max_failed_steps: int = 3,
                 restart_backoff_s: float = 1.0, healthy_after_s: float = 300.0,
                 warmup: Callable[[EnginePort], None] | None = None, nice: int = 0,
                 handoff: Callable[[threading.Event], None] | None = None, handoff_s: float = 0.0,
                 hold_s: float = 0.0, admit_s: float = 0.0, pace: Callable[[bool], None] | None = None) -> None:
        self._factory, self._loop, self.kv = factory, loop, kv
        self.nice = nice  # added to the engine thread's nice value (Linux: per thread), see _lower_priority
        self._warmup = warmup  # run on each new engine before it is ready (kernels compiled, paths run once)
        self.max_restarts, self.max_failed_steps, self.restart_backoff_s = max_restarts, max_failed_steps, \
            restart_backoff_s
        self.restarts = 0  # in a row: an engine that served healthy_after_s since its build clears them
        self.healthy_after_s = healthy_after_s
        self._on_outputs, self._on_fatal, self._on_ready = on_outputs, on_fatal, on_ready
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="moebus-engine", daemon=True)
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.stats: dict[str, Any] = {}  # replaced wholesale by the engine thread (atomic for readers)
        self.engine: EnginePort | None = None
        self.tokenizer: Any = None  # the engine's; kept while a new engine is built
        self._prefill_only: set[str] = set()  # request ids to stop (and extract) at their first token
        # After a step that made some request's first token, the thread waits (at most handoff_s)
        # for `handoff` to set the event once the loop has put that token on the bus: the next step
        # would otherwise hold both cores while the loop waits for one (c=1 TTFT on 2 cores).
        self._handoff, self.handoff_s = handoff, handoff_s
        # Then it keeps the cores free until hold_s after that step ended (when first tokens are at
        # least half of its outputs): the token still has to cross nats-server, the frontend and
        # the client, each of which needs a core in turn.
        self.hold_s = hold_s
        # An add while the thread sleeps on an empty queue waits (at most admit_s) until the thread
        # has woken with it: the loop blocks with the GIL released, so the thread starts on the
        # request at once instead of when the loop next goes idle (c=1 TTFT).
        self.admit_s = admit_s
        # Called on the engine thread before each step (True) and while idle (False): co-located
        # workers sharing the cores set this step's threads there (platforms/cpu/core_share.py).
        self._pace = pace
        self._asleep = False  # the thread is blocked on an empty command queue (idle)
        self._woke = threading.Event()
        self._fresh: set[str] = set()  # added, no output yet
        # Adds waiting for engine.prepare (a grammar compiling off this thread): their commands,
        # applied again when the work is done ("prepared"), dropped when aborted meanwhile.
        self._preparing: dict[str, tuple] = {}
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._thread.ident

    def add(self, request_id: str, prompt_token_ids: list[int], params: Any, prefill_only: bool = False,
            resume: dict[int, list[int]] | None = None, images: Sequence[ImageEmbedding] = (),
            priority: int = 0, owner: str = "", block_hashes: BlockHashes | None = None) -> None:
        """params: the request's engine parameters, all n choices (the engine fans out); resume: a
        migrated request's open choices and their tokens so far; images: encoder rows of the prompt;
        priority: the engine queue's order (lower first); owner: the API call it is part of;
        block_hashes: the prompt's stable block hashes as the frontend computed them."""
        handing = self._asleep and self.admit_s > 0
        if handing:
            self._woke.clear()
        self._cmds.put(("add", request_id, prompt_token_ids, params, prefill_only, resume, images, priority, owner,
                        block_hashes))
        if handing:
            self._woke.wait(self.admit_s)

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: Any,
               payload: Any, images: Sequence[ImageEmbedding] = ()) -> None:
        """Admit a request prefilled elsewhere (payload None: recompute its prompt here)."""
        self._cmds.put(("inject", request_id, prompt_token_ids, first_token, params, payload, images))

    def call(self, fn: Callable[[EnginePort], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between steps; the future gets its result."""
        fut = self._loop.create_future()
        self._cmds.put(("call", fn, fut))
        return fut

    def abort(self, request_id: str) -> None:
        """Every choice of the request."""
        self._cmds.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(_STOP)
        if self._thread.ident:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self.nice:
            _lower_priority(self.nice)
        while True:
            built = time.monotonic()
            try:
                self.engine = None
                self.engine = self._factory()
                self.tokenizer = self.engine.tokenizer
                if self._warmup is not None and not self.engine.lockstep:  # a lockstep group steps together
                    started = time.monotonic()
                    self._warmup(self.engine)
                    log.info("engine warmed up in %.2fs", time.monotonic() - started)
                if self.kv is not None:
                    self.kv.bind(self.engine)
                self.stats = dict(self.engine.stats())
                self._prefill_only.clear()
                self._fresh.clear()  # the failed engine's requests are gone with it
                self._preparing.clear()
                self.ready.set()
                self._loop.call_soon_threadsafe(self._on_ready)
                self._loop_forever()
                return
            except BaseException as e:  # its requests are lost; a new engine may serve the next ones
                log.exception("engine failed")
                self.ready.clear()
                if self.engine is not None and time.monotonic() - built >= self.healthy_after_s:
                    self.restarts = 0  # a failure long after the last one starts a new budget
                final = (self._stopping or self.restarts >= self.max_restarts or self.engine is None
                         or self.engine.lockstep)
                if final:
                    self.failed = e  # before on_fatal runs: it reads this to tell a restart from the end
                self._loop.call_soon_threadsafe(self._on_fatal, e)
                if final:
                    return
                self.restarts += 1
                log.warning("rebuilding the engine (restart %d of %d)", self.restarts, self.max_restarts)
            finally:
                self._close_engine()
            time.sleep(self.restart_backoff_s * self.restarts)

    def _close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                log.warning("closing the engine failed", exc_info=True)

    def _loop_forever(self) -> None:
        engine = self.engine
        lockstep = engine.lockstep
        while True:
            idle = not engine.has_unfinished_requests()
            if idle and self._pace is not None:
                self._pace(False)  # before sleeping: a peer must not wait on this one's claim to the cores
            failed: list[AddFailed] = []
            # Block only when idle; a lockstep rank only briefly (the group waits on its step).
            wait = (0.002 if cast(LockstepEngine, engine).group_idle else 0.0) if lockstep else (0.5 if idle else 0.0)
            try:
                cmd = self._sleep_for_cmd(wait) if wait else self._cmds.get_nowait()
                while True:
                    if cmd is _STOP:
                        return
                    self._apply(cmd, failed)
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                pass
            busy = lockstep or engine.has_unfinished_requests()
            if busy and self._pace is not None:
                self._pace(True)
            started_ns = time.time_ns()
            outputs = engine.step() if busy else []
            step = StepTiming(started_ns, time.time_ns(), len(outputs))
            if engine.failed_steps_in_a_row >= self.max_failed_steps:
                raise RuntimeError(f"{engine.failed_steps_in_a_row} engine steps in a row failed")
            prefilled = self._extract_prefilled(outputs) if self._prefill_only else []
            self.stats = dict(engine.stats())
            if outputs or failed or prefilled:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs, failed, prefilled, step)
                self._hand_off(outputs, step.ended_ns)

    def _sleep_for_cmd(self, wait: float) -> Any:
        self._asleep = True
        try:
            return self._cmds.get(timeout=wait)
        finally:
            self._asleep = False
            self._woke.set()

    def _hand_off(self, outputs: Sequence[EngineOutput], step_ended_ns: int) -> None:
        first = [o.request_id for o in outputs if o.request_id in self._fresh]
        self._fresh.difference_update(first)
        if first and self._handoff is not None and self.handoff_s > 0:
            sent = threading.Event()
            self._loop.call_soon_threadsafe(self._handoff, sent)
            sent.wait(self.handoff_s)
        if first and 2 * len(first) >= len(outputs) and (left := self.hold_s - (time.time_ns() - step_ended_ns) / 1e9) > 0:
            time.sleep(left)  # not when the batch's other requests are most of it: they would pay for it

    def _extract_prefilled(self, outputs: Sequence[EngineOutput]) -> list[Prefilled]:
        done: list[Prefilled] = []
        for out in outputs:
            if out.request_id not in self._prefill_only:
                continue
            self._prefill_only.discard(out.request_id)
            if out.finished:
                continue  # ended at its first token: nothing to hand over
            payload, started_ns = None, time.time_ns()
            try:
                payload = self.kv.extract(self.engine, out.request_id)
            except Exception:  # the decode worker then recomputes the prompt
                log.warning("KV extraction of %s failed", out.request_id, exc_info=True)
            self.engine.abort_request(out.request_id)
            done.append(Prefilled(out.request_id, payload, (started_ns, time.time_ns())))
        return done

    def _apply(self, cmd: tuple, failed: list[AddFailed], prepared: bool = False) -> None:
        kind = cmd[0]
        if kind == "call":
            _, fn, fut = cmd
            try:
                result, exc = fn(self.engine), None
            except Exception as e:
                result, exc = None, e
            self._loop.call_soon_threadsafe(_settle, fut, result, exc)
        elif kind == "add":
            _, rid, prompt, params, prefill_only, resume, images, priority, owner, hashes = cmd
            try:
                if not prepared and self._held(rid, params, cmd):
                    return
                extra = {"images": image_spans(images)} if images else {}
                if priority:
                    extra["priority"] = priority
                if owner:
                    extra["owner"] = owner
                if hashes is not None:
                    extra["block_hashes"] = hashes
                if resume is None:
                    self.engine.add_request(rid, prompt, params, **extra)
                else:
                    self.engine.add_request(rid, prompt, params, resume=resume, **extra)
            except Exception as e:  # rejected (ValueError) or raised on its parameters: this request alone
                failed.append(AddFailed.of(rid, e))
                return
            if prefill_only:
                self._prefill_only.add(rid)
            self._fresh.add(rid)
        elif kind == "inject":
            _, rid, prompt, first_token, params, payload, images = cmd
            try:
                if prepared or not self._held(rid, params, cmd):
                    self.kv.inject(self.engine, rid, prompt, first_token, params, payload, image_spans(images))
            except Exception as e:
                failed.append(AddFailed.of(rid, e))
        elif kind == "prepared":
            _, rid, ready = cmd
            held = self._preparing.pop(rid, None)
            if held is None:
                return  # aborted while it waited, or its engine was replaced
            if (e := ready.exception()) is not None:
                failed.append(AddFailed.of(rid, e))
                return
            self._apply(held, failed, prepared=True)
        else:
            self._preparing.pop(cmd[1], None)
            self._prefill_only.discard(cmd[1])
            self._fresh.discard(cmd[1])
            self.engine.abort_request(cmd[1])


    def _held(self, rid: str, params: Any, cmd: tuple) -> bool:
        """Whether the add must wait for engine.prepare (its grammar compiling, off this thread,
        under a deadline): the command comes back as "prepared" when that is done, and is then
        applied without asking again (a grammar evicted from the cache meanwhile compiles in
        add_request: one known to compile within the deadline)."""
        ready = self.engine.prepare(params)
        if ready is None:
            return False
        self._preparing[rid] = cmd
        ready.add_done_callback(lambda f: self._cmds.put(("prepared", rid, f)))
        return True


def _lower_priority(by: int) -> None:
    """This thread's nice value raised by `by`; the compute threads torch starts from it inherit it.
    The event loop thread, the bus and the other services then run first when they wake up, so a
    token already made goes out while the next step computes, not after it (Linux: nice is per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:  # not permitted, or no per-thread priorities here: run as is
        log.warning("could not lower the engine thread's priority by %d", by, exc_info=True)


def image_spans(images: Sequence[ImageEmbedding]) -> list[Any]:
    """Wire rows -> the engine's ImageSpans (torch is imported only when a request has images)."""
    if not images:
        return []
    from moebus.engine.multimodal import ImageSpan
    from moebus.engine.vision.wire import rows_from_bytes

    return [ImageSpan(i.offset, rows_from_bytes(i.raw(), i.dtype, i.num_tokens, i.hidden_size), i.content_hash)
            for i in images]


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
