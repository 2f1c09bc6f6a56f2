"""One torchrun worker of bench/network.py: trains the same model with each system in turn on the
same batches and times its steps; rank 0 writes every system's figures as JSON to --out.

Systems: `strata-<name>` (Strata's own step path, `trainer.parallelize`: forward/backward over the
micro-batches, reduce and clip, the optimizer step, with the layout of SYSTEMS[name]); `ddp`
(torch DistributedDataParallel, no_sync on all but the last micro-batch); `fsdp2` (`fully_shard`
per block and the root over the world); `hsdp` (`fully_shard` over a 2-D mesh: sharded inside a
node, replicated across nodes); `local` (the same model with no communication at all: each rank
trains alone, all at once, so the machine is as busy as in the others — the "no-communication
step time" the exposed communication is measured against).

Batches come from a fixed random Markov chain (a learnable language: the loss falls from ln V
towards the chain's entropy), the same on every system. For each system the local rank 0 of each
node reads its link's byte and packet counters around the timed steps, and every rank reports
the inter-node bytes Strata's communication layer counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from strata import config as config_mod
from strata.data.tokens import Batch
from strata.model import build_model, lm_loss
from strata.parallel import comm
from strata.parallel.topology import build_topology, layout_from_config
from strata.trainer.parallelize import build_optimizer, parallelize

G = "global"
SYSTEMS = {  # Strata layouts: zero.* shard levels (params, grads, optim) and extra keys
    "dp": {},
    "zero3": {
        "zero": {
            "params": {"shard_over": G},
            "grads": {"shard_over": G},
            "optim": {"shard_over": G},
            "hierarchical": False,
        }
    },
    "zero3-hier": {
        "zero": {
            "params": {"shard_over": G},
            "grads": {"shard_over": G},
            "optim": {"shard_over": G},
        }
    },
    "hpz": {
        "zero": {
            "params": {"shard_over": G},
            "grads": {"shard_over": G},
            "optim": {"shard_over": G},
            "secondary_params": {"shard_over": "node"},
        }
    },
    "3level": {
        "zero": {
            "params": {"shard_over": "node"},
            "grads": {"shard_over": "node"},
            "optim": {"shard_over": G},
        }
    },
    # CO2 across the nodes, each rank's optimizer state partitioned inside its node: each rank's
    # outer exchange is its half of the model, not all of it
    "co2": {"co2": {"enabled": True, "outer_every": 4}, "zero": {"optim": {"shard_over": "node"}}},
}
# MoE systems (bench/moe_dispatch.py): the model's feed-forward as 8 experts over ep=4 ranks on the two
# nodes; "-m1" routes each token to experts of one group of 4 (one node: node-limited routing, M = 1)
MOE = {"num_experts": 8, "top_k": 4, "expert_ffn": 64, "router": "sigmoid"}
for _dispatch in ("flat", "hierarchical"):
    for _suffix, _groups in (("", {}), ("-m1", {"route_groups": 2, "route_group_limit": 1})):
        SYSTEMS[f"moe-{_dispatch}{_suffix}"] = {
            "model": {"moe": MOE | _groups},
            "parallel": {"ep": 4, "ep_dispatch": _dispatch},
        }


def chain(vocab: int, seed: int = 7, successors: int = 4) -> torch.Tensor:
    """Each token's `successors` likely next tokens (a sparse random transition table)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, successors), generator=gen)


def markov_batch(table: torch.Tensor, n: int, seq: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, table.shape[0], (n,), generator=gen)
    picks = torch.randint(0, table.shape[1], (n, seq), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = table[tokens[:, t], picks[:, t]]
    return Batch(tokens[:, :-1], tokens[:, 1:])


class Run:
    """The model, batches and step function of one system on this rank."""

    def __init__(self, system: str, args, rank: int, world: int, local: int):
        self.system, self.args, self.rank, self.world = system, args, rank, world
        self.table = chain(args.vocab)
        self.cfg = config_mod.from_dict(self.raw_config(system), world_size=world)
        self.pm = None
        if system.startswith("strata-"):
            topo = build_topology(layout_from_config(self.cfg.parallel, world, local), rank)
            self.pm = parallelize(self.cfg, topo, torch.device("cpu"), args.vocab)
            return
        model = build_model(self.cfg.model, args.vocab, seed=self.cfg.train.seed)
        self.model: nn.Module = model
        if system == "ddp":
            self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        elif system in ("fsdp2", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if system == "fsdp2":
                mesh = init_device_mesh("cpu", (world,))
            else:
                mesh = init_device_mesh(
                    "cpu", (world // local, local), mesh_dim_names=("replicate", "shard")
                )
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.opt = build_optimizer(list(model.parameters()), self.cfg.optim, torch.device("cpu"))

    def raw_config(self, system: str) -> dict:
        a = self.args
        raw = {
            "model": {
                "n_layers": a.layers,
                "d_model": a.d_model,
                "n_heads": a.heads,
                "seq_len": a.seq,
                "vocab_size": a.vocab,
            },
            "train": {
                "global_batch_size": a.micro * a.accum * self.world,
                "micro_batch_size": a.micro,
                "seed": 11,
            },
            "optim": {"lr": a.lr, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
            "parallel": {"bucket_mb": a.bucket_mb},
        }
        return config_mod.merge_groups(raw, SYSTEMS.get(system.removeprefix("strata-"), {}))

    def batches(self, step: int) -> list[Batch]:
        a = self.args
        return [
            markov_batch(self.table, a.micro, a.seq, 1_000_000 * step + 1000 * m + self.rank)
            for m in range(a.accum)
        ]

    def step(self, step: int) -> float:
        micro = self.batches(step)
        if self.pm is not None:
            loss = self.pm.forward_backward(micro)
            self.pm.reduce_and_clip(1.0)
            self.pm.step()
            return float(loss)
        total = 0.0
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            sync = (
                self.model.no_sync()
                if self.system == "ddp" and not last
                else contextlib.nullcontext()
            )
            if self.system in ("fsdp2", "hsdp"):
                self.model.set_requires_gradient_sync(last)
            with sync:
                loss = lm_loss(self.model(batch.inputs), batch.targets) / len(micro)
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def eval_loss(self) -> float:
        """Mean loss on held-out batches (the same on every system and rank)."""
        batches = [
            markov_batch(self.table, self.args.micro, self.args.seq, 7_000_000 + i)
            for i in range(4)
        ]
        with torch.no_grad():
            if self.pm is not None:
                self.pm.close_co2_round()
                sums = [self.pm.eval_loss(b) for b in batches]  # (mean × rows, rows) each
                return float(sum(s for s, _ in sums) / sum(n for _, n in sums))
            losses = [float(lm_loss(self.model(b.inputs), b.targets)) for b in batches]
            return sum(losses) / len(batches)


def link_counters(ifname: str) -> dict[str, int]:
    base = Path("/sys/class/net") / ifname / "statistics"
    return {
        k: int((base / k).read_text()) for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", required=True, help="comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    results = {}
    for system in args.systems.split(","):
        run = Run(system, args, rank, world, local)
        for s in range(args.warmup):
            run.step(s)
        dist.barrier()
        before_link = link_counters(ifname) if int(os.environ["LOCAL_RANK"]) == 0 else None
        before_count = comm.bytes_by_link["inter-node"]
        losses, start = [], time.perf_counter()
        for s in range(args.warmup, args.warmup + args.steps):
            losses.append(run.step(s))
        elapsed = torch.tensor([time.perf_counter() - start])
        counted = comm.bytes_by_link["inter-node"] - before_count
        dist.barrier()  # every rank done before the counters are read again
        after_link = link_counters(ifname) if before_link is not None else None
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        eval_loss = run.eval_loss()
        link = (
            {k: after_link[k] - before_link[k] for k in after_link}
            if after_link and before_link
            else None
        )
        gathered = [None] * world
        dist.all_gather_object(gathered, {"counted": counted, "link": link})
        results[system] = {
            "step_s": float(elapsed) / args.steps,
            "losses": losses,
            "eval_loss": eval_loss,
            "counted_inter_node_bytes": sum(g["counted"] for g in gathered),
            "links": [g["link"] for g in gathered if g["link"] is not None],
        }
        del run
        comm.forget_groups()
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {"results": results, "args": vars(args), "ln_vocab": math.log(args.vocab)}, indent=1
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
