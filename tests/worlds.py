"""Start a real gloo world of N local processes for a test and collect each rank's results; find the
processes a test started, by the marker in their environment."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strata.net import free_port

# What every world's ranks import, loaded once by the forkserver they are forked from: a spawned
# rank would import torch and Strata anew (seconds each on 2 cores), and forking the test process
# itself would copy whatever threads and state the earlier tests left in it.
PRELOAD = ["torch", "torch.distributed", "strata.parallel.runtime", "strata.trainer.parallelize", "strata.trainer.loop"]


def run_world(
    worker: Callable, size: int, out_dir: Path, *args, timeout_s: float = 120, start_method: str = "forkserver"
) -> list:
    """Run `worker(rank, size, port, out_dir, *args)` on `size` processes (they init gloo on
    tcp://127.0.0.1:port); each saves its result to out_dir/rank{rank}.pt, returned in rank order.
    Fails the test if a rank raises or the world outlives `timeout_s` (a hang kills the ranks)."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    ctx = mp.start_processes(
        worker, args=(size, free_port(), str(out_dir), *args), nprocs=size, join=False, start_method=start_method
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):  # raises if a rank failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"world of {size} did not finish within {timeout_s}s")
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(size)]


def join_world(rank: int, size: int, port: int, timeout_s: float = 60) -> None:
    """In a `run_world` worker: one thread, and the gloo world on tcp://127.0.0.1:port."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def marked_processes(marker: str, **env: str) -> list[int]:
    """Pids of live processes whose environment has STRATA_TEST_ID=marker and every `env` item
    (torchrun starts each worker in a session of its own, so process groups do not find them)."""
    want = [f"STRATA_TEST_ID={marker}".encode()] + [f"{k}={v}".encode() for k, v in env.items()]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            items = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(w in items for w in want):
            found.append(int(entry.name))
    return found
