"""Start a real gloo world of N local processes for a test and collect each rank's results."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from strata.net import free_port


def run_world(
    worker: Callable, size: int, out_dir: Path, *args, timeout_s: float = 120, start_method: str = "spawn"
) -> list:
    """Run `worker(rank, size, port, out_dir, *args)` on `size` processes (they init gloo on
    tcp://127.0.0.1:port); each saves its result to out_dir/rank{rank}.pt, returned in rank order.
    Fails the test if a rank raises or the world outlives `timeout_s` (a hang kills the ranks)."""
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
