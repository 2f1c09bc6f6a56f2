"""Local multi-process launch: build the torchrun command (c10d rendezvous) that starts one
`strata train` worker per process, start the node's snapshot agent beside it when snapshots are
on, and host a standalone rendezvous store for jobs that must survive the loss of any node."""

from __future__ import annotations

import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from strata.checkpoint.agent_protocol import SOCKET_ENV
from strata.errors import StrataError
from strata.net import free_port

SECRET_ENV = "STRATA_SNAPSHOT_SECRET"


@dataclass(frozen=True)
class LaunchPlan:
    """What to start: processes per node, nodes, where the rendezvous lives, and how restarts go."""

    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = "strata"
    max_restarts: int = 0
    external_store: bool = False  # the c10d store runs in `strata store`, not in the first torchrun
    join_timeout_s: int = 600  # how long a rendezvous waits for every node (a replacement, after a loss)
    snapshots: bool = False  # start this node's snapshot agent


def torchrun_args(plan: LaunchPlan) -> list[str]:
    """torchrun's own flags (elastic c10d rendezvous, as on a real cluster)."""
    endpoint = plan.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    # A dead node's heartbeat expires after 2 s, and a round closes 1 s after the last node joins.
    conf = f"join_timeout={plan.join_timeout_s},last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    if plan.external_store:
        conf += ",is_host=false"
    return [
        "--nnodes",
        str(plan.nnodes),
        "--nproc-per-node",
        str(plan.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        plan.rdzv_id,
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(plan.max_restarts),
    ]


def worker_args(config_path: str, overrides: list[str], resume: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    """The `strata train` arguments each worker runs with (as a module, so no console script is needed)."""
    args = ["-m", "strata.launch.cli", "train", config_path, *overrides]
    return args + (["--resume", resume] if resume else []) + list(extra)


def torchrun_command(
    plan: LaunchPlan, config_path: str, overrides: list[str], resume: str | None, extra: tuple[str, ...] = ()
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(plan),
        *worker_args(config_path, overrides, resume, extra),
    ]


def launch_env(plan: LaunchPlan) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # torch ≤ 2.13 hands restarted workers the addresses of the previous attempt's store and they
    # never connect (pytorch/pytorch#135712): a fresh store per attempt makes --max-restarts work.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if plan.snapshots and SECRET_ENV not in env:
        if plan.nnodes > 1:
            raise StrataError(
                f"snapshots on {plan.nnodes} nodes need one secret shared by every node's agents: "
                f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
                "with the same value on every node"
            )
        env[SECRET_ENV] = secrets.token_hex(32)
    return env


def start_agent(plan: LaunchPlan, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """This node's snapshot agent, in a session of its own (not a child of torchrun's workers, so a
    worker crash leaves it running); returns it and its socket path, once it listens."""
    directory = tempfile.mkdtemp(prefix="strata-snapshot-")  # 0700: only this user reaches the socket
    path = os.path.join(directory, "agent.sock")
    host = (plan.rdzv_endpoint or "127.0.0.1").rsplit(":", 1)[0]
    local = host in ("127.0.0.1", "localhost", "::1")
    cmd = [
        sys.executable,
        "-m",
        "strata.launch.snapshot_agent",
        "--socket",
        path,
        "--parent",
        str(os.getpid()),
        "--advertise",
        "127.0.0.1" if local else socket.getfqdn(),
        "--bind",
        "127.0.0.1" if local else "0.0.0.0",
    ]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # finds the package as the workers do
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise StrataError(f"the snapshot agent did not start (exit code {proc.poll()}); see its message above")
        time.sleep(0.02)
    return proc, path


def run_local(
    plan: LaunchPlan, config_path: str, overrides: list[str], resume: str | None, extra: tuple[str, ...] = ()
) -> int:
    """Run torchrun in the foreground (and the node's snapshot agent beside it); returns torchrun's
    exit code. `extra`: more `strata train` flags."""
    env = launch_env(plan)
    agent = None
    if plan.snapshots:
        agent, env[SOCKET_ENV] = start_agent(plan, env)
    cmd = torchrun_command(plan, config_path, overrides, resume, extra)
    print("strata launch:", shlex.join(cmd), flush=True)
    try:
        return subprocess.call(cmd, env=env)
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait()
            Path(env[SOCKET_ENV]).unlink(missing_ok=True)
            Path(env[SOCKET_ENV]).parent.rmdir()


def serve_store(host: str, port: int) -> None:
    """Host a c10d rendezvous store until killed: with it outside every torchrun (each started with
    `--rdzv-store external`), losing any node leaves the rendezvous alive for its replacement."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False)
    print(f"strata store: c10d rendezvous store at {host}:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        del store
