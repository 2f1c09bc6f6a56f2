"""One torchrun worker of bench/context_parallel.py: every rank of a world of cp ranks (gloo) times
causal attention's forward and backward over one sequence split across them, for each system:

    strata-ring       strata.parallel.context.ring_attention on the load-balanced split
    strata-alltoall   strata.parallel.context.alltoall_attention (Ulysses) on the load-balanced split
    deepspeed-ulysses DeepSpeed's DistributedAttention (its all-to-all around torch SDPA) on contiguous
                      sequence chunks, the layout it is written for

and, with --memory, the RSS high-water mark of one forward and backward of a small Strata model at
the full sequence, cut to this rank's tokens (cp = world size; a world of one is the unsplit model).
Rank 0 writes the figures as JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from strata.parallel import comm
from strata.parallel.context import alltoall_attention, ring_attention, shard
from strata.parallel.runtime import proc_status_bytes, reset_peak_rss


def ulysses(group):
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.comm.init_distributed(dist_backend="gloo")  # wraps the world torch already has

    def local(q, k, v, *args, **kwargs):  # (b, s, h, d) -> causal SDPA over the whole sequence
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)

    attention = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def run(q, k, v, _group):  # ours are (b, h, s, d); DeepSpeed's are (b, s, h, d)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch_dim_idx=0)
        return out.transpose(1, 2)

    return run


def time_system(name: str, attend, args: argparse.Namespace, group) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=g) for _ in range(4))
    if name == "deepspeed-ulysses":  # contiguous chunks
        q, k, v, grad = (t.chunk(cp, dim=2)[rank].contiguous() for t in (q, k, v, grad))
    else:
        q, k, v, grad = (shard(t, cp, rank, dim=2).contiguous() for t in (q, k, v, grad))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    times, moved = [], 0.0
    for i in range(args.warmup + args.reps):
        dist.barrier()
        before = sum(n for (dim, _), n in comm.bytes_moved.items() if dim == "cp")
        start = time.perf_counter()
        out = attend(q, k, v, group)
        out.backward(grad)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
            moved = sum(n for (dim, _), n in comm.bytes_moved.items() if dim == "cp") - before
        q.grad = k.grad = v.grad = None
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank is done
    return {
        "step_s": statistics.median(slowest.tolist()),
        "times_s": slowest.tolist(),
        "bytes_per_rank": moved,
    }


def memory(args: argparse.Namespace) -> dict:
    """Peak RSS above the baseline of one forward and backward of a small model at --seq tokens."""
    from strata.config import ModelConfig
    from strata.model import build_model, lm_loss, set_rope_buffers
    from strata.parallel.context import apply_context_parallel, positions

    cp, rank = dist.get_world_size(), dist.get_rank()
    cfg = ModelConfig(
        n_layers=args.mem_layers,
        d_model=args.mem_d_model,
        n_heads=args.heads,
        seq_len=args.seq,
        vocab_size=256,
        ffn_hidden=2 * args.mem_d_model,
    )
    model = build_model(cfg, 256, seed=0)
    if cp > 1:
        apply_context_parallel(model, dist.group.WORLD, args.mem_mode)
        set_rope_buffers(model, cfg, torch.device("cpu"), positions(args.seq, cp, rank))
    tokens = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = shard(tokens[:, :-1], cp, rank), shard(tokens[:, 1:], cp, rank)
    gc.collect()
    dist.barrier()
    base = proc_status_bytes("VmRSS")
    exact = reset_peak_rss()
    lm_loss(model(x), y).backward()
    peak = proc_status_bytes("VmHWM") - base
    dist.barrier()
    return {"peak_above_baseline_bytes": peak, "hwm_reset": exact, "tokens_per_rank": x.shape[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="strata-ring,strata-alltoall,deepspeed-ulysses")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--mem-layers", type=int, default=2)
    ap.add_argument("--mem-d-model", type=int, default=256)
    ap.add_argument("--mem-mode", default="ring")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result: dict = {"world": dist.get_world_size(), "seq": args.seq, "systems": {}}
    systems = {"strata-ring": ring_attention, "strata-alltoall": alltoall_attention}
    if args.memory:
        result["memory"] = memory(args)
    elif dist.get_world_size() > 1:
        for name in [s for s in args.systems.split(",") if s]:
            attend = ulysses(dist.group.WORLD) if name == "deepspeed-ulysses" else systems[name]
            result["systems"][name] = time_system(name, attend, args, dist.group.WORLD)
    world = dist.group.WORLD if dist.get_world_size() > 1 else None
    gathered = comm.all_gather_objects(result.get("memory"), world) if args.memory else None
    if dist.get_rank() == 0:
        if gathered is not None:
            result["memory_by_rank"] = gathered
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
