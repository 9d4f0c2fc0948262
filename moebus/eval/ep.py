"""The v4-ep2 row: a model served by an expert-parallel group of 2 ranks on CPU (gloo), routed
experts sharded between them, attention data parallel (each rank its own requests and KV).

The group's ranks are processes (launcher.launch_ep_group). Every model forward is a collective
(each MoE layer all-to-alls), so both ranks run forwards in lockstep: prompts go out round-robin,
one per rank at a time (the `alone` rows' way, so the tokens compare with theirs), and the text's
chunks likewise, each rank scoring its own chunk through decode steps on its EP model
(candidate.decode_logits); with an odd count, a rank re-scores the last chunk to keep in step
and drops the result.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moebus.engine.distributed.dp_engine import DPEngine
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.eval.candidate import decode_logits, greedy_params
from moebus.eval.text import Chunk

WORLD = 2
# Forkserver children fork from one process that imported these once, instead of once per rank.
PRELOAD = ["moebus.engine.distributed", "moebus.eval.ep", "torch._dynamo"]


@dataclass(slots=True)
class GroupRun:
    logits: list[torch.Tensor]  # per chunk, the scored rows
    tokens: list[list[int]]  # per prompt, the greedy tokens
    counters: dict[str, int]  # how the experts were split: ranks, MoE layers, expert slots a rank


def run_group(model: str, engine_kwargs: Mapping[str, object], chunks: list[Chunk], prompts: list[list[int]],
              max_tokens: int, timeout_s: float = 1800.0) -> GroupRun:
    """Launch the group, run the chunks and prompts on it, gather the ranks' results."""
    results = launch_ep_group(model, WORLD, _rank_main, (chunks, prompts, max_tokens),
                              engine_kwargs=dict(engine_kwargs), start_method="forkserver",
                              preload=PRELOAD, timeout_s=timeout_s)
    logits = {i: lg for r in results for i, lg in r["logits"].items()}
    tokens = {i: t for r in results for i, t in r["tokens"].items()}
    return GroupRun([logits[i] for i in range(len(chunks))], [tokens[i] for i in range(len(prompts))],
                    results[0]["counters"])


def _mine(rank: int, world: int, count: int) -> list[tuple[int, bool]]:
    """(item index, kept) per lockstep round: rank, rank + world, ...; past the end the last item
    again, not kept."""
    return [(min(j * world + rank, count - 1), j * world + rank < count) for j in range(-(-count // world))]


def _rank_main(engine: DPEngine, chunks: list[Chunk], prompts: list[list[int]], max_tokens: int) -> dict:
    rank, world = engine.group.rank, engine.group.world_size
    tokens: dict[int, list[int]] = {}
    for i, kept in _mine(rank, world, len(prompts)):
        if kept:  # an idle rank still steps: it joins the group's collectives with dummy forwards
            engine.add_request(f"eval-{i}", prompts[i], greedy_params(max_tokens))
        done = engine.run_to_completion()
        if kept:
            tokens[i] = done[f"eval-{i}"]
    logits: dict[int, torch.Tensor] = {}
    for i, kept in _mine(rank, world, len(chunks)):
        lg = decode_logits(engine.engine, chunks[i])
        if kept:
            logits[i] = lg
    layers = engine.layers
    counters = {"ranks": world, "moe_layers": len(layers),
                "expert_slots_per_rank": layers[0].slots_per_rank if layers else 0}
    return {"tokens": tokens, "logits": logits, "counters": counters}
