"""CO2 vs synchronous data parallelism over a slow inter-node link.

Two simulated nodes, one rank each (gloo, forked processes on this machine), train the same tiny
Llama-style model on real text (a few Python stdlib sources, prepared with `trainer.data.prepare`
as the tests do) with AdamW. The inter-node link is slowed by `comm.set_link_delay` (a per-byte
delay on the ring all-reduce's wire bytes), set so that one gradient all-reduce costs `--link-x`
times a measured local compute step.

    sync DP  every step: forward/backward, all-reduce the gradients (slow link), AdamW step
    CO2      every step: forward/backward, AdamW step on the local gradient; every H steps the
             parameter delta goes out asynchronously and the one from a round ago is applied

Prints the mean step time of each, the speedup (sync / CO2), the final validation loss of each
and the loss ratio (CO2 / sync), all measured in this run.

    python bench/co2_slow_network.py [--steps 200] [--outer-every 8] [--link-x 2]
"""
from __future__ import annotations

import argparse
import datetime
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel import comm
from parallel.co2 import CO2
from parallel.data_parallel import GradientBuckets
from parallel.runtime import free_port
from parallel.topology import Layout, build_topology
from trainer.config import ModelConfig
from trainer.data import BatchLoader, TokenDataset, eval_batches, prepare
from trainer.model import build_model, lm_loss

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = ["argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "json/decoder.py",
          "json/encoder.py", "difflib.py", "shlex.py"]
SEQ, MICRO, SEED, LR = 64, 8, 0, 3e-3
EVAL_BATCHES = 8


def make_model(data_dir: Path) -> torch.nn.Module:
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=SEQ)
    return build_model(cfg, TokenDataset(data_dir, "train", SEQ).vocab_size, seed=SEED)


def val_loss(model: torch.nn.Module, data_dir: Path) -> float:
    val = TokenDataset(data_dir, "val", SEQ)
    with torch.no_grad():
        losses = [lm_loss(model(x), y).item() for x, y in eval_batches(val, EVAL_BATCHES, MICRO, 0, 1)]
    return sum(losses) / len(losses)


def train(mode: str, rank: int, args, data_dir: Path, buckets_group) -> dict:
    """One run of `args.steps` steps in `mode` ('sync' or 'co2'); step times exclude evaluation."""
    model = make_model(data_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    loader = BatchLoader(TokenDataset(data_dir, "train", SEQ), SEED, 2 * MICRO, MICRO, rank, 2)
    buckets = GradientBuckets(params, bucket_bytes=1 << 30)
    co2 = CO2(params, buckets_group, outer_every=args.outer_every, outer_lr=args.outer_lr,
              outer_momentum=args.outer_momentum, staleness_penalty=args.staleness_penalty,
              clip=args.clip) if mode == "co2" else None
    dist.barrier()
    start = time.monotonic()
    for _ in range(args.steps):
        (x, y), = loader.next_step()
        lm_loss(model(x), y).backward()
        if co2 is None:
            buckets.all_reduce_mean(buckets_group, 2)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if co2 is not None:
            co2.after_local_step()
    if co2 is not None:
        co2.finish()
    dist.barrier()
    elapsed = time.monotonic() - start
    return {"step_s": elapsed / args.steps, "val_loss": val_loss(model, data_dir)}


def compute_step_s(data_dir: Path, n: int = 10) -> float:
    """Median time of one local forward/backward/AdamW step (no communication)."""
    model = make_model(data_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = BatchLoader(TokenDataset(data_dir, "train", SEQ), SEED, MICRO, MICRO)
    times = []
    for _ in range(n):
        (x, y), = loader.next_step()
        t = time.monotonic()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.monotonic() - t)
    return sorted(times)[n // 2]


def worker(rank: int, port: int, args, data_dir: Path, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        topo = build_topology(Layout(dp=2, ranks_per_node=1), rank)  # registers dp as inter-node
        step = torch.tensor([compute_step_s(data_dir)])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        n_bytes = 4 * sum(p.numel() for p in make_model(data_dir).parameters())
        link_s = args.link_x * step.item()
        comm.set_link_delay("inter-node", link_s / n_bytes)  # ring all-reduce over 2: wire bytes = size
        results = {mode: train(mode, rank, args, data_dir, topo.groups["dp"]) for mode in ("sync", "co2")}
        if rank == 0:
            out.update(results, compute_s=step.item(), link_s=link_s, n_bytes=n_bytes)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--outer-every", type=int, default=8, help="H: local steps per CO2 round")
    ap.add_argument("--link-x", type=float, default=2.0, help="one gradient all-reduce costs this many compute steps")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--staleness-penalty", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare([STDLIB / f for f in CORPUS], data_dir, val_fraction=0.2, root=STDLIB)
        with mp.Manager() as manager:
            out = manager.dict()
            mp.start_processes(worker, args=(free_port(), args, data_dir, out), nprocs=2, start_method="fork")
            r = dict(out)
    sync, co2 = r["sync"], r["co2"]
    print(f"model {r['n_bytes'] / 1e6:.2f} MB fp32; compute step {1e3 * r['compute_s']:.1f} ms; simulated "
          f"inter-node all-reduce {1e3 * r['link_s']:.1f} ms; {args.steps} steps, H={args.outer_every}")
    print(f"sync DP : {1e3 * sync['step_s']:.1f} ms/step, final val loss {sync['val_loss']:.4f}")
    print(f"CO2     : {1e3 * co2['step_s']:.1f} ms/step, final val loss {co2['val_loss']:.4f}")
    print(f"speedup (sync/CO2 step time): {sync['step_s'] / co2['step_s']:.2f}x; "
          f"loss ratio (CO2/sync): {co2['val_loss'] / sync['val_loss']:.4f}")


if __name__ == "__main__":
    main()
