"""One torchrun worker of bench/plan_time.py's link calibration: measures the inter-node link of the
namespace cluster with torch.distributed on gloo, as the trainer's collectives see it. Rank 0 writes
the figures as JSON to --out.

With one rank per node (world 2): one-way bandwidth (--repeats sends of --mb MB from node 0 to
node 1, closed by a one-element acknowledgement), a two-rank all-reduce of --mb MB (each direction
carries the whole tensor once), and the latency of a small message (half a one-element ping-pong's
round trip) and of a one-element all-reduce. With two ranks per node (world 4, ranks 0-1 on node 0,
2-3 on node 1): both ranks of node 0 send to their peer on node 1 at once (the link the node's ranks
share), a four-rank all-reduce of --mb MB, and each rank's all-reduce of --mb MB with its peer on
the other node, both pairs at once (data parallelism's inter-node hop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def one_way(
    src: int, dst: int, nbytes: int, repeats: int, peers: list[tuple[int, int]]
) -> float | None:
    """Seconds for `repeats` sends of `nbytes` from `src` to `dst`, each pair of `peers` sending at the
    same time (this rank takes part if it is in one); None on ranks that only watch. Every pair's
    ranks report, so the slowest of them covers the whole time the link was shared."""
    rank = dist.get_rank()
    payload = torch.zeros(nbytes // 4, dtype=torch.float32)
    ack = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for s, d in peers:
        if rank == s:
            for _ in range(repeats):
                dist.send(payload, d)
            dist.recv(ack, d)
        elif rank == d:
            for _ in range(repeats):
                dist.recv(payload, s)
            dist.send(ack, s)
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed if any(rank in pair for pair in peers) else None


def ping_pong(a: int, b: int, rounds: int) -> float | None:
    """Median one-way latency of a one-element message between ranks `a` and `b` (half a round trip)."""
    rank = dist.get_rank()
    msg = torch.zeros(1)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == a:
            dist.send(msg, b)
            dist.recv(msg, b)
        elif rank == b:
            dist.recv(msg, a)
            dist.send(msg, a)
        times.append((time.perf_counter() - start) / 2)
    dist.barrier()
    return statistics.median(times) if rank == a else None


def all_reduce_s(nbytes: int, repeats: int, group: dist.ProcessGroup | None = None) -> float:
    """Median seconds of an all-reduce of `nbytes` over `group` (the world; after one untimed)."""
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    dist.all_reduce(t, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=8.0, help="message size in MB (1e6 bytes)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=50, help="ping-pong and small all-reduce rounds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = int(args.mb * 1e6)
    res: dict = {"world": world, "bytes": nbytes, "repeats": args.repeats}
    warm = [(r, r + world // 2) for r in range(world // 2)]
    one_way(0, world // 2, 1 << 20, 1, warm)  # every pair's connection up, TCP windows open
    if world == 2:
        t = one_way(0, 1, nbytes, args.repeats, [(0, 1)])
        lat = ping_pong(0, 1, args.rounds)
        if rank == 0:
            res["one_way_s"] = t
            res["one_way_gbps"] = nbytes * args.repeats * 8 / t / 1e9
            res["latency_s"] = lat
        res["all_reduce_s"] = all_reduce_s(nbytes, args.repeats)
        res["all_reduce_gbps"] = (
            nbytes * 8 / res["all_reduce_s"] / 1e9
        )  # each direction carries it once
        res["small_all_reduce_s"] = all_reduce_s(4, args.rounds)
    else:  # two ranks per node: ranks 0, 1 on node 0 and 2, 3 on node 1
        half = world // 2
        peers = [(r, r + half) for r in range(half)]
        t = one_way(0, half, nbytes, args.repeats, peers)
        times = [None] * world
        dist.all_gather_object(times, t)
        slowest = max(x for x in times if x is not None)
        res["concurrent_one_way_s"] = slowest
        res["concurrent_one_way_gbps"] = (
            nbytes * args.repeats * half * 8 / slowest / 1e9
        )  # the node's whole link
        res["all_reduce_s"] = all_reduce_s(nbytes, args.repeats)
        # the data-parallel inter-node hop: each rank all-reduces with its peer on the other node,
        # every pair at once (each direction of the node's link carries `half` times the tensor)
        pairs = [dist.new_group([r, r + half]) for r in range(half)]
        res["pairs_all_reduce_s"] = all_reduce_s(nbytes, args.repeats, pairs[rank % half])
        res["pairs_all_reduce_gbps"] = nbytes * half * 8 / res["pairs_all_reduce_s"] / 1e9
        lat = ping_pong(0, half, args.rounds)
        res["latency_s"] = lat
    if rank == 0:
        Path(args.out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
