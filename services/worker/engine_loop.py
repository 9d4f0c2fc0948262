"""Drives the synchronous engine on one dedicated thread.

The asyncio side only enqueues commands (add/abort/stop); the thread applies them between
steps, so the engine is never touched from two threads. Outputs go back to the event loop with
call_soon_threadsafe, with a stats snapshot taken on the engine thread.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AddFailed:
    """An add_request the engine rejected (e.g. prompt longer than max_model_len)."""

    sub_id: str
    error: str


OnOutputs = Callable[[list[Any], list[AddFailed]], None]
_STOP = object()


class EngineLoop:
    def __init__(self, factory: Callable[[], Any], loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
                 on_fatal: Callable[[BaseException], None], on_ready: Callable[[], None] = lambda: None) -> None:
        self._factory, self._loop = factory, loop
        self._on_outputs, self._on_fatal, self._on_ready = on_outputs, on_fatal, on_ready
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="moebus-engine", daemon=True)
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.stats: dict[str, Any] = {}  # replaced wholesale by the engine thread (atomic for readers)
        self.engine: Any = None

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._thread.ident

    def add(self, sub_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self._cmds.put(("add", sub_id, prompt_token_ids, params))

    def abort(self, sub_id: str) -> None:
        self._cmds.put(("abort", sub_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._cmds.put(_STOP)
        if self._thread.ident:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self.stats = dict(self.engine.stats())
            self.ready.set()
            self._loop.call_soon_threadsafe(self._on_ready)
            self._loop_forever()
        except BaseException as e:  # report, the service turns unhealthy and fails its requests
            log.exception("engine thread died")
            self.failed = e
            self._loop.call_soon_threadsafe(self._on_fatal, e)
        finally:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            failed: list[AddFailed] = []
            try:  # block only when idle; otherwise just take what has arrived
                cmd = self._cmds.get(timeout=0.5) if idle else self._cmds.get_nowait()
                while True:
                    if cmd is _STOP:
                        return
                    self._apply(cmd, failed)
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                pass
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self.stats = dict(engine.stats())
            if outputs or failed:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs, failed)

    def _apply(self, cmd: tuple, failed: list[AddFailed]) -> None:
        if cmd[0] == "add":
            _, sub_id, prompt, params = cmd
            try:
                self.engine.add_request(sub_id, prompt, params)
            except (ValueError, KeyError, TypeError) as e:
                failed.append(AddFailed(sub_id, str(e)))
        else:
            self.engine.abort_request(cmd[1])
