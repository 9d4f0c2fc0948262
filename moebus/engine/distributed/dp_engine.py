"""Attention data parallelism: one `LLMEngine` per rank over an expert-parallel model.

Each rank owns its requests, scheduler and KV cache; attention and dense weights are replicated,
routed experts are sharded (EPMoE). A model step is collective (every EP layer all-to-alls), so
`DPEngine.step` is too: all ranks call it in lockstep. It first all-reduces "anyone has work?"
(if nobody does, no rank runs a forward), then runs the local engine step; a rank whose scheduler
produced nothing joins the step's collectives with a 0-token `dummy_forward`. EPLB rebalancing
runs between steps, so in-flight requests keep their KV cache and only expert weights move.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moebus.engine.config import EngineConfig
from moebus.engine.distributed.ep_moe import EPMoE, dummy_forward, shard_moe_layers
from moebus.engine.distributed.eplb import RebalanceReport, rebalance
from moebus.engine.distributed.group import EPGroup
from moebus.engine.distributed.placement import imbalance
from moebus.engine.llm_engine import LLMEngine, RequestOutput
from moebus.engine.multimodal import ImageSpan
from moebus.engine.sampling import SamplingParams
from moebus.kv.hashing import BlockHashes
from moebus.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from concurrent.futures import Future

    from moebus.kv.connector import KVConnector


@dataclass(slots=True)
class EPConfig:
    num_redundant_experts: int = 0  # extra expert copies over the group (E + this must split evenly)
    eplb_interval: int = 0  # group steps between automatic rebalances; 0 = only on rebalance()
    eplb_min_gain: float = 0.05  # keep a layer's placement unless max/mean drops by more than this
    count_loads: bool = False  # record expert loads even without automatic EPLB

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0 or self.eplb_interval < 0 or not 0 <= self.eplb_min_gain < 1:
            raise ValueError("need num_redundant_experts >= 0, eplb_interval >= 0, 0 <= eplb_min_gain < 1")


@dataclass(slots=True)
class DPStats:
    group_steps: int = 0  # steps where some rank had work
    dummy_steps: int = 0  # of which this rank only joined collectives
    rebalances: list[list[RebalanceReport]] = field(default_factory=list)


class DPEngine:
    """An engine port (moebus.engine.port.LockstepEngine) like LLMEngine, whose requests (n > 1
    fanned out as there), KV connector and stats are this rank's own; but `step` is a collective:
    serving loops must call it every iteration, idle or not (`lockstep`)."""

    lockstep = True  # for serving loops: call step() even with no local requests
    tokenizer: Tokenizer
    group_idle: bool

    def __init__(self, config: EngineConfig, group: EPGroup, ep: EPConfig | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        if config.async_scheduling:
            # The forward would run on the executor thread after step() returns, so this rank
            # could not tell whether it still owes the group a dummy forward this step.
            raise ValueError("DPEngine needs async_scheduling=False")
        if torch.device(config.device) != group.device:
            raise ValueError(f"engine device {config.device} but the {group.backend} group runs on {group.device}")
        self.ep = ep or EPConfig()
        self.group = group
        self.engine = LLMEngine(config, tokenizer)
        self.tokenizer = self.engine.tokenizer
        self.layers: list[EPMoE] = shard_moe_layers(self.engine.model, group, self.ep.num_redundant_experts)
        if self.ep.eplb_interval or self.ep.count_loads:
            for layer in self.layers:
                layer.enable_load_counting()
        self.dp_stats = DPStats()
        self.group_idle = False  # set by step(): no rank had work

    # --- per-rank request API (local, no collectives) -------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, resume: Mapping[int, Sequence[int]] | None = None,
                    images: Sequence[ImageSpan] = (), owner: str = "",
                    block_hashes: BlockHashes | None = None) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, priority, resume, images, owner, block_hashes)

    def prepare(self, params: SamplingParams) -> Future[None] | None:
        return self.engine.prepare(params)  # this rank's own compile: no collective

    def abort_request(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def failed_steps_in_a_row(self) -> int:
        return self.engine.failed_steps_in_a_row

    @property
    def kv(self) -> KVConnector:
        """This rank's KV (moved between the group's steps: no collective involved)."""
        return self.engine.kv

    def stats(self) -> dict[str, float | int]:
        s = self.dp_stats
        return {**self.engine.stats(), "ep_rank": self.group.rank, "ep_size": self.group.world_size,
                "group_steps": s.group_steps, "dummy_steps": s.dummy_steps, "rebalances": len(s.rebalances)}

    # --- collectives: every rank calls these in the same order -----------------------------
    def step(self) -> list[RequestOutput]:
        if self.group.device.type == "cuda":  # the current device is per thread; a serving loop may own its own
            torch.cuda.set_device(self.group.device)
        busy = torch.tensor([int(self.engine.has_unfinished_requests())], device=self.group.device)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group.group)
        self.group_idle = not bool(busy.item())
        if self.group_idle:
            return []
        before = self.layers[0].num_calls if self.layers else 0
        outs = self.engine.step()
        if self.layers:
            ran = self.layers[0].num_calls - before
            if ran > 1:
                raise RuntimeError(f"engine ran {ran} forwards in one step; the group expects 1")
            if ran == 0:
                dummy_forward(self.layers)
                self.dp_stats.dummy_steps += 1
        self.dp_stats.group_steps += 1
        if self.ep.eplb_interval and self.dp_stats.group_steps % self.ep.eplb_interval == 0:
            self.rebalance()
        return outs

    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until no rank has work; returns this rank's generated tokens per request id."""
        tokens: dict[str, list[int]] = {}
        while True:
            for out in self.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if self.group_idle:
                return tokens

    def rebalance(self, min_gain: float | None = None) -> list[RebalanceReport]:
        """EPLB over the loads recorded since the last rebalance (collective)."""
        gain = self.ep.eplb_min_gain if min_gain is None else min_gain
        reports = rebalance(self.layers, self.group, gain)
        self.dp_stats.rebalances.append(reports)
        return reports

    def rank_loads(self) -> list[list[int]]:
        """Measured assignments computed per rank, [layer][rank], since the last reset (collective)."""
        if not self.layers:
            return []
        if any(layer.slot_load is None for layer in self.layers):
            raise RuntimeError("load counting is off: set EPConfig(count_loads=True) or eplb_interval")
        local = torch.stack([layer.slot_load.sum() for layer in self.layers])
        gathered = [torch.empty_like(local) for _ in range(self.group.world_size)]
        dist.all_gather(gathered, local, group=self.group.group)
        return torch.stack(gathered, dim=1).tolist()

    def load_imbalance(self) -> float:
        """max/mean measured rank load, summed over layers (collective)."""
        per_layer = self.rank_loads()
        return imbalance([sum(col) for col in zip(*per_layer, strict=True)]) if per_layer else 1.0

    def reset_loads(self) -> None:
        for layer in self.layers:
            layer.reset_load_counters()

    def close(self) -> None:
        self.engine.close()
