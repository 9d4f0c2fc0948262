"""Expert parallelism + attention data parallelism for the MoE models (torch.distributed).

group.py      process group (gloo on CPU, NCCL on GPU) -> `EPGroup`
placement.py  expert -> (rank, slot) placement, redundant replicas
ep_moe.py     `EPMoE`: routed experts sharded over ranks, all-to-all dispatch / combine
eplb.py       load-balancing planner + point-to-point expert weight moves
dp_engine.py  `DPEngine`: one LLMEngine per rank, lockstep steps, dummy forwards, EPLB
launcher.py   `launch_ep_group`: start N ranks on one host
"""
from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.ep_moe import EPMoE, dummy_forward, shard_moe_layers
from moebus.engine.distributed.eplb import plan_moves, plan_placement, rebalance
from moebus.engine.distributed.group import EPGroup, init_ep_group
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.engine.distributed.placement import Placement, imbalance

__all__ = ["DPEngine", "EPConfig", "EPGroup", "EPMoE", "Placement", "dummy_forward", "imbalance",
           "init_ep_group", "launch_ep_group", "plan_moves", "plan_placement", "rebalance", "shard_moe_layers"]
