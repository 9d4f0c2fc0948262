"""Expert-parallel serving: one worker group of `ep` ranks (attention DP: each rank its own
queue and KV cache, routed experts sharded), each rank a WorkerService `<instance>-ep<rank>`.

The ranks' engines step in lockstep (DPEngine.step is a collective); EngineLoop keeps stepping
idle ranks. Stopping: the parent terminates every rank (a rank alone cannot leave the group).
"""
from __future__ import annotations

import logging
import signal
import uuid
from typing import TYPE_CHECKING

from moebus.shared.runner import run

from .config import WorkerConfig

if TYPE_CHECKING:
    from moebus.engine.distributed.dp_engine import DPEngine

log = logging.getLogger(__name__)


def serve_rank(engine: DPEngine, cfg: WorkerConfig) -> None:
    """rank_main of launch_ep_group (top level: pickled into the rank process)."""
    from .service import WorkerService

    rank = engine.group.rank
    port = cfg.http_port + rank if cfg.http_port is not None else None
    rcfg = cfg.model_copy(update={"instance_id": f"{cfg.instance_id}-ep{rank}", "ep": 1, "http_port": port})
    run(WorkerService(rcfg, engine_factory=lambda: engine))


def serve_ep_group(cfg: WorkerConfig) -> None:
    from moebus.engine.distributed.dp_engine import EPConfig
    from moebus.engine.distributed.launcher import launch_ep_group

    if cfg.instance_id is None:
        cfg = cfg.model_copy(update={"instance_id": f"worker-{uuid.uuid4().hex[:8]}"})
    engine_kwargs = {k: v for k, v in cfg.engine.items() if k != "ep"}
    handle = launch_ep_group(cfg.model, cfg.ep, serve_rank, (cfg,), engine_kwargs=engine_kwargs,
                             ep=EPConfig(**cfg.engine.get("ep", {})), torch_threads=cfg.torch_threads or 1,
                             wait=False)

    def stop(*_: object) -> None:
        log.info("stopping EP group %s", cfg.instance_id)
        handle.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        handle.join()
    except RuntimeError:
        log.info("EP group %s ended", cfg.instance_id, exc_info=True)
