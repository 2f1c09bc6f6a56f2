"""Local multi-process launch: build the torchrun command (c10d rendezvous) that starts one
`strata train` worker per process."""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchPlan:
    """What to start: processes per node, nodes, and where the rendezvous lives."""
    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = "strata"
    max_restarts: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(plan: LaunchPlan) -> list[str]:
    """torchrun's own flags (elastic c10d rendezvous, as on a real cluster)."""
    endpoint = plan.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    return ["--nnodes", str(plan.nnodes), "--nproc-per-node", str(plan.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", plan.rdzv_id,
            "--max-restarts", str(plan.max_restarts)]


def worker_args(config_path: str, overrides: list[str], resume: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    """The `strata train` arguments each worker runs with (as a module, so no console script is needed)."""
    args = ["-m", "launch.cli", "train", config_path, *overrides]
    return args + (["--resume", resume] if resume else []) + list(extra)


def torchrun_command(plan: LaunchPlan, config_path: str, overrides: list[str], resume: str | None,
                     extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan),
            *worker_args(config_path, overrides, resume, extra)]


def run_local(plan: LaunchPlan, config_path: str, overrides: list[str], resume: str | None,
              extra: tuple[str, ...] = ()) -> int:
    """Run torchrun in the foreground; returns its exit code. `extra`: more `strata train` flags."""
    cmd = torchrun_command(plan, config_path, overrides, resume, extra)
    print("strata launch:", shlex.join(cmd), flush=True)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.call(cmd, env=env)
