"""EP=2 with its two ranks on two "hosts" against the same two ranks on one, and one worker (issue 35).

Modes, same checkpoint and requests (request i goes to rank i % 2; the single worker serves all):
- single: one LLMEngine in this process, --threads torch threads (both cores), no collectives;
- loopback: EP=2 in the root namespace, gloo over 127.0.0.1 (what bench_ep.py / eplb_skew.py run);
- one-ns: both ranks in host a's network namespace, gloo on eth0's address (the kernel keeps it on lo);
- hosts: rank 0 in host a's namespace, rank 1 in host b's (services/netns.py): every collective
  crosses veth a -> router -> veth b, the rendezvous on rank 0's address.
Each rank is its own process (launch_ep_group, one torch thread) that enters its namespace before
torch starts threads or opens sockets (`rank_setup`). Per batch size (requests over both ranks):
prefill until every request has its first token, --warm decode steps, then --steps timed decode
steps; ms a step is the median over steps of the slower rank. Prefill: --prefill N x L tokens in one
step. In the timed steps torch.distributed's all_to_all_single / all_reduce are wrapped to count calls,
the bytes this rank sends to the other (its own share of an all-to-all stays in memory) and the time
spent inside them. From those counts a link model: time = calls x latency + bytes / bandwidth.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_ep_hosts.py --model /work/peers/granite-moe

NCCL: the same script with --backend nccl --modes loopback,hosts on a machine with 2 GPUs (a rank
per GPU by LOCAL_RANK = rank; netns.InNamespaces gives each namespace its own NCCL_HOSTID so NCCL uses
its socket transport over the veth, not shared memory / P2P). Across two real GPU hosts the ranks
are started per host instead (init_ep_group(2, rank, "nccl", "tcp://<rank 0's host>:<port>")); this
script does not do that. Needs root and iproute2 for the namespace modes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moebus.engine.config import EngineConfig
from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams
from moebus.services.netns import Hosts, InNamespaces
from moebus.shared.ports import free_port

ENGINE = {"dtype": "bfloat16", "max_model_len": 1024, "num_kv_blocks": 512}
LINKS = {"25GbE, 15us": (15e-6, 25e9 / 8), "100GbE RDMA, 4us": (4e-6, 100e9 / 8)}  # (latency per call, B/s)


@dataclass(slots=True)
class Comm:
    sent: list[int] = field(default_factory=list)  # per collective: bytes this rank sent to the other ranks
    seconds: float = 0.0  # inside collectives, waiting for slower ranks included

    def mark(self) -> tuple[int, float]:
        return len(self.sent), self.seconds

    def undo(self, mark: tuple[int, float]) -> None:
        del self.sent[mark[0]:]
        self.seconds = mark[1]


@contextlib.contextmanager
def counted(comm: Comm) -> Iterator[None]:
    """Count the EP collectives (ep_moe.py, dp_engine.py call them through the torch.distributed module)."""
    a2a, allreduce = dist.all_to_all_single, dist.all_reduce

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input_split_sizes or [input.shape[0] // world] * world
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        comm.sent.append(sum(n for r, n in enumerate(rows) if r != rank) * row_bytes)
        return timed(a2a, output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_reduce(tensor, *args, **kw):
        comm.sent.append(tensor.numel() * tensor.element_size())
        return timed(allreduce, tensor, *args, **kw)

    def timed(fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            comm.seconds += time.perf_counter() - t0

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_reduce = a2a, allreduce


def prompt(i: int, length: int) -> list[int]:
    return torch.randint(100, 49000, (length,), generator=torch.Generator().manual_seed(i)).tolist()


def everyone(engine: LLMEngine | DPEngine, flag: bool) -> bool:
    """`flag` on every rank: an all_gather on a DPEngine (not one of the counted collectives)."""
    if not isinstance(engine, DPEngine):
        return flag
    dev = engine.group.device  # NCCL: the flags live on the rank's GPU
    flags = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(engine.group.world_size)]
    dist.all_gather(flags, torch.tensor([int(flag)], device=dev))
    return all(bool(f.item()) for f in flags)


def idle(engine: LLMEngine | DPEngine, outs: list) -> bool:
    if isinstance(engine, DPEngine):
        return engine.group_idle  # no rank had work: that step ran no forward
    return not outs and not engine.has_unfinished_requests()


def run(engine: LLMEngine | DPEngine, tag: str, reqs: list[tuple[int, list[int]]], max_tokens: int,
        warm: int) -> dict:
    """Prefill `reqs` (until every rank's have their first token), `warm` decode steps, then decode to
    the end: the prefill's time, steps and collectives; (seconds, tokens) and collectives of the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in reqs:
        engine.add_request(f"{tag}-{i}", ids, params)
    started: set[str] = set()
    pre, prefill_steps = Comm(), 0
    t0 = time.perf_counter()
    with counted(pre):
        while not everyone(engine, len(started) == len(reqs)):
            started |= {o.request_id for o in engine.step() if o.new_token_ids}
            prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    for _ in range(warm):
        engine.step()
    comm, steps = Comm(), []
    with counted(comm):
        while True:
            mark, t0 = comm.mark(), time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if idle(engine, outs):
                comm.undo(mark)  # the step that found the group idle is no decode step
                break
            steps.append((dt, sum(len(o.new_token_ids) for o in outs)))
    return {"prefill_s": prefill_s, "prefill_steps": prefill_steps, "prefill_comm": asdict(pre), "steps": steps,
            "comm": asdict(comm)}


def serve(engine: LLMEngine | DPEngine, rank: int, world: int, plan: dict) -> dict:
    """The plan's prefill, then each decode batch; request i is rank i % world's."""
    mine = lambda n: [i for i in range(n) if i % world == rank]  # noqa: E731
    n, length = plan["prefill"]
    out = {"rank": rank, "layers": len(engine.layers) if isinstance(engine, DPEngine) else 0, "decode": {},
           "prefill": run(engine, "prefill", [(i, prompt(10_000 + i, length)) for i in mine(n)], 1, 0)}
    for b in plan["batches"]:
        out["decode"][b] = run(engine, f"b{b}", [(i, prompt(i, plan["prompt_len"])) for i in mine(b)],
                               1 + plan["warm"] + plan["steps"], plan["warm"])
    return out


PROBE_BYTES = (16, 4 << 10, 64 << 10, 1 << 20, 8 << 20)  # sent to the other rank by one all_to_all_single


def probe(device: torch.device, reps: int = 20) -> dict[int, float]:
    """The path's own cost: median seconds of an all_to_all_single that sends each size to the other rank."""
    out = {}
    for size in PROBE_BYTES:
        x = torch.zeros(2 * size, dtype=torch.uint8, device=device)  # half stays, half goes
        y = torch.empty_like(x)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            if device.type == "cuda":  # NCCL returns before the transfer is done
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times)
    return out


def rank_main(engine: DPEngine, plan: dict) -> dict:
    run(engine, "warmup", [(i, prompt(i, 64)) for i in range(engine.group.rank, 4, 2)], 4, 0)  # compile, caches
    return {**serve(engine, engine.group.rank, engine.group.world_size, plan), "probe": probe(engine.group.device)}


def single(model: str, plan: dict, threads: int, device: str) -> list[dict]:
    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=model, device=device, **ENGINE))
    run(engine, "warmup", [(i, prompt(i, 64)) for i in range(4)], 4, 0)
    res = serve(engine, 0, 1, plan)
    engine.close()
    return [res]


def ep(model: str, plan: dict, mode: str, backend: str, net: Hosts | None) -> list[dict]:
    kw: dict = {}
    if mode != "loopback":
        hosts = ("a", "a") if mode == "one-ns" else ("a", "b")
        host = net.address("a")
        kw = {"host": host, "port": net.run_in("a", lambda: free_port(host)),
              "rank_setup": InNamespaces(tuple(net.ns(h) for h in hosts))}
    return launch_ep_group(model, 2, rank_main, (plan,), engine_kwargs=ENGINE, ep=EPConfig(), backend=backend,
                           torch_threads=1, start_method="forkserver",
                           preload=["moebus.engine.distributed", "torch._dynamo"], timeout_s=1800, **kw)


def summarize(mode: str, ranks: list[dict], plan: dict) -> list[dict]:
    """One row per phase: the slower rank's time, all ranks' tokens and collectives (per rank)."""
    rows = []
    pre = [r["prefill"] for r in ranks]
    n, length = plan["prefill"]
    wall = max(p["prefill_s"] for p in pre)
    rows.append({"mode": mode, "phase": f"prefill {n}x{length}", "steps": pre[0]["prefill_steps"],
                 "ms_step": 1000 * wall / pre[0]["prefill_steps"], "tok_s": n * length / wall,
                 **comm_row([p["prefill_comm"] for p in pre], ranks[0]["layers"], pre[0]["prefill_steps"])})
    for b in plan["batches"]:
        dec = [r["decode"][b] for r in ranks]
        per_step = [max(s[i][0] for s in (d["steps"] for d in dec)) for i in range(len(dec[0]["steps"]))]
        tokens = sum(t for d in dec for _, t in d["steps"])
        rows.append({"mode": mode, "phase": f"decode b={b}", "steps": len(per_step),
                     "ms_step": 1000 * statistics.median(per_step), "tok_s": tokens / sum(per_step),
                     **comm_row([d["comm"] for d in dec], ranks[0]["layers"], len(per_step))})
    return rows


def comm_row(comms: list[dict], layers: int, steps: int) -> dict:
    """Per step: collectives; KiB on the critical path (collectives run one after another, each as long
    as its larger direction: the sum over calls of the most any rank sent); ms inside collectives on
    the rank that waited least there (the other also waits for this one's compute)."""
    if not comms[0]["sent"]:
        return {"layers": layers, "calls_step": 0.0, "kib_step": 0.0, "comm_ms_step": 0.0}
    critical = sum(max(call) for call in zip(*(c["sent"] for c in comms), strict=True))
    return {"layers": layers, "calls_step": len(comms[0]["sent"]) / steps, "kib_step": critical / steps / 1024,
            "comm_ms_step": 1000 * min(c["seconds"] for c in comms) / steps}


def model_cost(row: dict) -> dict:
    """Link model per step: calls x latency + bytes / bandwidth (a rank's sends and receives overlap:
    full duplex), as ms and as a share of the measured step."""
    out = {}
    for name, (lat, bw) in LINKS.items():
        ms = 1000 * (row["calls_step"] * lat + row["kib_step"] * 1024 / bw)
        out[name] = (ms, ms / row["ms_step"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/work/peers/granite-moe"))
    ap.add_argument("--modes", default="single,loopback,hosts", help="of single, loopback, one-ns, hosts")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="decode requests over both ranks")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warm", type=int, default=2, help="untimed decode steps first")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps")
    ap.add_argument("--prefill", default="8x256", help="N x L: N prompts of L tokens (over both ranks)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the single worker")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    n, length = (int(x) for x in args.prefill.split("x"))
    plan = {"batches": args.batches, "prompt_len": args.prompt_len, "warm": args.warm, "steps": args.steps,
            "prefill": (n, length)}
    modes = args.modes.split(",")
    rows: list[dict] = []
    probes: dict[str, dict[int, float]] = {}
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(Hosts(["a", "b"])) if {"one-ns", "hosts"} & set(modes) else None
        for mode in modes:
            t0 = time.perf_counter()
            if mode == "single":
                ranks = single(str(args.model), plan, args.threads, "cuda" if args.backend == "nccl" else "cpu")
            else:
                ranks = ep(str(args.model), plan, mode, args.backend, net)
            rows += summarize(mode, ranks, plan)
            if "probe" in ranks[0]:
                probes[mode] = {size: max(r["probe"][size] for r in ranks) for size in PROBE_BYTES}
            print(f"# {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"{'mode':>8} {'phase':>15} {'steps':>5} {'ms/step':>8} {'tok/s':>8} {'coll/step':>9} "
          f"{'KiB/step':>9} {'coll ms':>8}  " + "  ".join(f"{k:>22}" for k in LINKS))
    for r in rows:
        cost = "  ".join(f"{ms:>9.2f} ms {frac:>8.1%}" for ms, frac in model_cost(r).values())
        print(f"{r['mode']:>8} {r['phase']:>15} {r['steps']:>5} {r['ms_step']:>8.1f} {r['tok_s']:>8.1f} "
              f"{r['calls_step']:>9.1f} {r['kib_step']:>9.1f} {r['comm_ms_step']:>8.2f}  {cost}")
    print("one all_to_all_single, median us, by bytes each rank sends the other; GB/s from the largest - smallest:")
    for mode, p in probes.items():
        small, large = PROBE_BYTES[0], PROBE_BYTES[-1]
        gbs = (large - small) / (p[large] - p[small]) / 1e9
        print(f"{mode:>8} " + " ".join(f"{b:>8}: {1e6 * t:>8.0f}" for b, t in p.items()) + f"   {gbs:.2f} GB/s")
        own = [f"{r['phase']} {1000 * (r['calls_step'] * p[small] + r['kib_step'] * 1024 / gbs / 1e9):.1f}"
               for r in rows if r["mode"] == mode]
        print(f"{'':>8} the model with this path's figures, ms a step: " + ", ".join(own))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "probes": probes}, indent=1))


if __name__ == "__main__":
    main()
