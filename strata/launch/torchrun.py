"""Local multi-process launch: build the torchrun command (c10d rendezvous, or static with a fixed
node rank) that starts one `strata train` worker per process, start the node's snapshot agent
beside it when snapshots are on (restarted if it dies), run torchrun under the `supervisor` until
it ends, and host a standalone rendezvous store for jobs that must survive the loss of any node."""

from __future__ import annotations

import errno
import functools
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata.checkpoint.agent_protocol import SOCKET_ENV
from strata.errors import StrataError
from strata.launch.supervisor import (
    FORWARDED_SIGNALS,
    KILL_MARGIN_S,
    STATUS_ENV,
    STOP_GRACE_S,
    Supervisor,
    workers_preempted,
)
from strata.net import (
    bind_errno,
    free_port,
    interface_address,
    is_loopback,
    resolve,
    split_endpoint,
)

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
    # how long a rendezvous waits for every node (a replacement, after a loss)
    join_timeout_s: int = 600
    snapshots: bool = False  # start this node's snapshot agent
    # Static rendezvous (torchrun's --node-rank/--master-addr/--master-port): a fixed node rank and
    # node 0's address instead of a c10d endpoint; no restarts.
    node_rank: int | None = None
    master_addr: str = ""
    master_port: int | None = None
    net_ifname: str = ""  # the interface gloo and NCCL use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)
    # How torchrun starts each worker: forked from the node's fork server, which has imported torch
    # and Strata once (strata.launch.elastic), or as a fresh Python (plain torchrun).
    worker_start: str = "forkserver"

    @property
    def static(self) -> bool:
        """Whether the rendezvous is static (a fixed node rank and master address) rather than
        c10d."""
        return self.node_rank is not None or bool(self.master_addr) or self.master_port is not None


DEFAULT_MASTER_PORT = 29500  # torchrun's
WORKER_STARTS = ("forkserver", "fresh")


def check_plan(plan: LaunchPlan) -> None:
    """Refuse a plan whose nodes could never meet: without an endpoint every node would pick its own
    free local port and wait for the others there until the join timeout; a static rendezvous
    missing a part or mixed with c10d's flags; an interface this node does not have; and counts
    torchrun would refuse with a traceback."""
    if plan.worker_start not in WORKER_STARTS:
        raise StrataError(
            f"--worker-start {plan.worker_start!r}: must be one of {', '.join(WORKER_STARTS)}"
        )
    for flag, value, least in (
        ("--nproc", plan.nproc_per_node, 1),
        ("--nnodes", plan.nnodes, 1),
        ("--max-restarts", plan.max_restarts, 0),
        ("--join-timeout", plan.join_timeout_s, 1),
    ):
        if value < least:
            raise StrataError(f"{flag} {value}: must be >= {least}")
    if plan.net_ifname:
        _check_ifname(plan.net_ifname)
    if plan.static:
        _check_static(plan)
        return
    if plan.rdzv_endpoint:
        _check_endpoint(plan.rdzv_endpoint)
        return
    if plan.external_store:
        raise StrataError(
            "--rdzv-store external needs the address of the `strata store` every node joins: "
            "add --rdzv-endpoint HOST:PORT (start it with `strata store --port PORT` on HOST)"
        )
    if plan.nnodes > 1:
        raise StrataError(
            f"--nnodes {plan.nnodes} needs a rendezvous every node can reach: add --rdzv-endpoint "
            "HOST:PORT with the first node's address (the same on every node), or run `strata "
            "store --port PORT` on a host and give every node --rdzv-store external "
            "--rdzv-endpoint HOST:PORT, or give every node --node-rank R --master-addr HOST "
            "(static: node 0's address, R = 0..N-1)"
        )


def _check_static(plan: LaunchPlan) -> None:
    """A static rendezvous: every part given, nothing of c10d's, a node rank in range."""
    if plan.rdzv_endpoint:
        raise StrataError(
            "--node-rank/--master-addr/--master-port (static rendezvous) and --rdzv-endpoint "
            "(c10d) are two ways "
            "for nodes to meet: give one of them"
        )
    if plan.external_store:
        raise StrataError(
            "--rdzv-store external hosts a c10d rendezvous: it needs --rdzv-endpoint, not "
            "--node-rank/--master-addr/--master-port (static rendezvous, whose store is node 0's)"
        )
    if plan.node_rank is None:
        raise StrataError(
            "static rendezvous needs --node-rank R on every node: a different R in "
            f"0..{plan.nnodes - 1}, node 0 at --master-addr"
        )
    if not 0 <= plan.node_rank < plan.nnodes:
        raise StrataError(
            f"--node-rank {plan.node_rank}: must be 0..{plan.nnodes - 1} with "
            f"--nnodes {plan.nnodes}"
        )
    if not plan.master_addr:
        raise StrataError(
            "static rendezvous needs --master-addr HOST: the address of the node with --node-rank "
            "0, the same on every node"
        )
    if plan.master_port is not None and not 1 <= plan.master_port <= 65535:
        raise StrataError(f"--master-port {plan.master_port}: must be 1..65535")
    if plan.max_restarts:
        raise StrataError(
            f"--max-restarts {plan.max_restarts} needs a c10d rendezvous (--rdzv-endpoint): with a "
            "static one a node restarts only its own workers, which the other nodes never rejoin"
        )


def _check_ifname(ifname: str) -> None:
    """--net-ifname names an interface of this node (its network namespace)."""
    names = sorted(name for _, name in socket.if_nameindex())
    if ifname not in names and not Path("/sys/class/net", ifname).exists():
        raise StrataError(
            f"--net-ifname {ifname!r}: this node has no such interface; it has {', '.join(names)}"
        )


def _check_endpoint(endpoint: str) -> None:
    """--rdzv-endpoint is HOST:PORT (or HOST, torchrun's default port) with a port torchrun can use."""
    try:
        host, _ = split_endpoint(endpoint)
    except ValueError:
        host = ""
    if not host:
        raise StrataError(
            f"--rdzv-endpoint {endpoint!r}: write it as HOST:PORT with a port "
            "1..65535, e.g. node1:29400"
        )


def rdzv_is_host(endpoint: str, external_store: bool = False) -> bool | None:
    """Whether this node's torchrun hosts the c10d rendezvous store at `endpoint` (torchrun's
    `is_host`), or None to leave it to torch. torch's own guess compares the endpoint with this
    machine's hostname and the addresses that hostname resolves to, so it fails wherever the
    hostname resolves elsewhere (Debian's 127.0.1.1, a hostname on another interface): no node hosts
    the store and every node times out. Here: an endpoint that resolves to one of this node's own
    non-loopback addresses (a socket can bind it) is hosted here, unless its port is taken (another
    torchrun of this job on this node got there first: then a client); any other endpoint is not.
    Loopback endpoints (several simulated nodes on one machine) keep torch's guess, which falls back
    from host to client when the port is taken, as an explicit `is_host` never does. An external
    store (`strata store`) is never hosted by torchrun."""
    if external_store:
        return False
    host, port = split_endpoint(endpoint)
    if is_loopback(host):
        return None
    addresses = resolve(host)
    if not addresses or any(is_loopback(addr[0]) for _, addr in addresses):
        # e.g. this machine's own name on 127.0.1.1: torch's guess
        return None if addresses else False
    local = [
        (family, addr)
        for family, addr in addresses
        if bind_errno(family, (addr[0], 0, *addr[2:])) == 0
    ]
    if not local:
        return False
    family, addr = local[0]
    return bind_errno(family, (addr[0], port or C10D_DEFAULT_PORT, *addr[2:])) != errno.EADDRINUSE


C10D_DEFAULT_PORT = 29400  # torchrun's, for an endpoint without a port


def node_address(plan: LaunchPlan) -> str | None:
    """The address the other nodes reach this one at, for what this node hosts (the workers' store
    when it holds rank 0, its snapshot agent): the --net-ifname interface's, else the address this
    node reaches the rendezvous host from; None on one machine (a loopback rendezvous) or when the
    rendezvous host does not resolve. torchrun's own choice, this machine's fully qualified name,
    is wrong wherever that name does not resolve to this node on every other node."""
    if plan.net_ifname:
        return interface_address(plan.net_ifname)
    host, port = split_endpoint(plan.master_addr if plan.static else plan.rdzv_endpoint)
    if not host or is_loopback(host):
        return None
    for family, addr in resolve(host, port or C10D_DEFAULT_PORT):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)  # UDP: picks the route, sends nothing
            except OSError:
                continue
            mine = s.getsockname()[0]
        return None if is_loopback(mine) else mine
    return None


def interface_problem(plan: LaunchPlan, env: dict[str, str]) -> str | None:
    """Why gloo's workers on several nodes will likely not reach each other, or None: no interface named
    (--net-ifname, GLOO_SOCKET_IFNAME) and this machine's hostname resolves only to loopback addresses,
    which gloo then binds."""
    if plan.nnodes == 1 or plan.net_ifname or env.get("GLOO_SOCKET_IFNAME"):
        return None
    name = socket.gethostname()
    addresses = resolve(name)
    if not addresses or not all(is_loopback(addr[0]) for _, addr in addresses):
        return None
    return (
        f"this machine's hostname {name!r} resolves to {addresses[0][1][0]} (loopback), which gloo "
        "binds: workers on the other nodes will not reach these; add --net-ifname IF (the "
        "interface the nodes share, e.g. eth0)"
    )


def torchrun_args(plan: LaunchPlan) -> list[str]:
    """torchrun's own flags: an elastic c10d rendezvous, as on a real cluster, or a static one."""
    check_plan(plan)
    common = ["--nnodes", str(plan.nnodes), "--nproc-per-node", str(plan.nproc_per_node)]
    local = node_address(plan)
    if local:
        common += ["--local-addr", local]
    if plan.static:
        return common + [
            "--node-rank",
            str(plan.node_rank),
            "--master-addr",
            plan.master_addr,
            "--master-port",
            str(plan.master_port or DEFAULT_MASTER_PORT),
            "--rdzv-id",
            plan.rdzv_id,
            "--rdzv-conf",
            f"timeout={plan.join_timeout_s}",  # how long node 0's store waits for every node
            "--max-restarts",
            "0",
        ]
    endpoint = plan.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    # A dead node's heartbeat expires after 2 s, and a round closes 1 s after the last node joins.
    conf = f"join_timeout={plan.join_timeout_s},last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    is_host = rdzv_is_host(endpoint, plan.external_store)
    if is_host is not None:
        conf += f",is_host={str(is_host).lower()}"
    return common + [
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


@dataclass(frozen=True)
class WorkerCommand:
    """What each worker runs: `strata COMMAND CONFIG [key=value ...] [--resume R] [EXTRA ...]`
    (`train`, or `eval`; as a module, so no console script is needed)."""

    config_path: str
    overrides: tuple[str, ...] = ()
    resume: str | None = None
    extra: tuple[str, ...] = ()
    command: str = "train"

    def args(self) -> list[str]:
        """The Python arguments each worker runs: `-m strata.launch.cli COMMAND CONFIG overrides`,
        then --resume and the extra flags."""
        args = ["-m", "strata.launch.cli", self.command, self.config_path, *self.overrides]
        return args + (["--resume", self.resume] if self.resume else []) + list(self.extra)


def torchrun_command(plan: LaunchPlan, worker: WorkerCommand) -> list[str]:
    """The command that starts this node's workers: torchrun (or `strata.launch.elastic`, its fork
    server variant, when `worker_start` is forkserver on Linux) with the plan's arguments and
    each worker's command line."""
    forked = plan.worker_start == "forkserver" and sys.platform.startswith("linux")
    return [
        sys.executable,
        "-m",
        "strata.launch.elastic" if forked else "torch.distributed.run",
        *torchrun_args(plan),
        *worker.args(),
    ]


def launch_env(plan: LaunchPlan) -> dict[str, str]:
    """The environment torchrun starts with: this process's, plus unbuffered output, the store and
    signal settings torchrun needs for restarts and stops, the network interface, and the
    snapshot agents' secret (made here for one node; several nodes must share one exported)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if plan.nproc_per_node > 1:
        # torchrun's own default for several workers on a node, set here so that the fork server,
        # started before torchrun's imports, already has the environment the workers will.
        env.setdefault("OMP_NUM_THREADS", "1")
    # torch ≤ 2.13 hands restarted workers the addresses of the previous attempt's store and they
    # never connect (pytorch/pytorch#135712): a fresh store per attempt makes --max-restarts work.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torchrun's --signals-to-handle and --shutdown-timeout, as environment variables (PET_*) so
    # that a torch without those flags still starts: SIGUSR1 must reach the workers, not kill
    # torchrun.
    env["PET_SIGNALS_TO_HANDLE"] = ",".join(sig.name for sig in FORWARDED_SIGNALS)
    env["PET_SHUTDOWN_TIMEOUT"] = str(STOP_GRACE_S)
    if plan.net_ifname:  # without the flag, values the environment already has pass through
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = plan.net_ifname
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
    # 0700: only this user reaches the socket
    directory = tempfile.mkdtemp(prefix="strata-snapshot-")
    path = os.path.join(directory, "agent.sock")
    proc = _spawn_agent(plan, env, path)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise StrataError(
                f"the snapshot agent did not start (exit code {proc.poll()}); see its message above"
            )
        time.sleep(0.02)
    return proc, path


def _spawn_agent(plan: LaunchPlan, env: dict[str, str], path: str) -> subprocess.Popen:
    """Start an agent listening at `path` (a socket file left there by a dead one is removed first)."""
    Path(path).unlink(missing_ok=True)
    host = split_endpoint(plan.master_addr if plan.static else plan.rdzv_endpoint or "127.0.0.1")[0]
    local = is_loopback(host)
    cmd = [
        sys.executable,
        "-m",
        "strata.launch.snapshot_agent",
        "--socket",
        path,
        "--parent",
        str(os.getpid()),
        "--advertise",
        "127.0.0.1" if local else node_address(plan) or socket.getfqdn(),
        "--bind",
        "127.0.0.1" if local else "0.0.0.0",
    ]
    # finds the package as the workers do
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class AgentKeeper:
    """Keeps this node's snapshot agent running while torchrun runs: `check` (called by the
    Supervisor every POLL_S) restarts an agent that died (a crash, SIGKILL, the OOM killer) on the
    same socket path, with the same secret and environment. The new agent holds no snapshots; the
    workers reconnect at their next snapshot (`checkpoint.snapshot`) and fill it again.

    The limit: an agent that dies more than MAX_RESTARTS times within RESTART_WINDOW_S is not
    restarted again (something is wrong with the node or the agent; restarting it in a loop would
    only cost the workers a failed reconnect per snapshot). Snapshots are then off for the rest of
    the run; training goes on, protected by its disk checkpoints (checkpoint.interval)."""

    MAX_RESTARTS = 3
    RESTART_WINDOW_S = 60.0

    plan: LaunchPlan
    env: dict[str, str]
    proc: subprocess.Popen
    path: str
    deaths: list[float] = field(default_factory=list)  # when each death was noticed (monotonic)
    given_up: bool = False

    def check(self) -> None:
        """Restart the agent if it has died, unless it died more than MAX_RESTARTS times within
        RESTART_WINDOW_S (then warn once and leave snapshots off)."""
        code = self.proc.poll()
        if code is None or self.given_up:
            return
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < self.RESTART_WINDOW_S] + [now]
        how = _how_it_ended(code)
        if len(self.deaths) > self.MAX_RESTARTS:
            self.given_up = True
            print(
                f"strata launch: warning: the snapshot agent exited ({how}), {len(self.deaths)} "
                f"times within {self.RESTART_WINDOW_S:.0f} s; not restarting it: in-memory "
                "snapshots are off for the rest of this run (training continues; disk checkpoints "
                "still protect it)",
                file=sys.stderr,
                flush=True,
            )
            return
        self.proc = _spawn_agent(self.plan, self.env, self.path)
        print(
            f"strata launch: the snapshot agent exited ({how}); restarted it",
            file=sys.stderr,
            flush=True,
        )

    def stop(self) -> None:
        """Stop the agent (SIGTERM, then SIGKILL after KILL_MARGIN_S) and remove its socket and
        directory."""
        _stop_agent(self.proc, self.path)


def _stop_agent(agent: subprocess.Popen, socket_path: str) -> None:
    agent.terminate()
    try:
        agent.wait(KILL_MARGIN_S)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
    Path(socket_path).unlink(missing_ok=True)
    Path(socket_path).parent.rmdir()


def run_local(plan: LaunchPlan, worker: WorkerCommand) -> int:
    """Run torchrun in the foreground (and the node's snapshot agent beside it); returns torchrun's
    exit code, or 128 + the signal that stopped the job, or PREEMPTED_EXIT (75) when every worker
    saved and stopped on that signal (see `Supervisor.wait`); each worker runs `worker`."""
    check_plan(plan)
    env = launch_env(plan)
    problem = interface_problem(plan, env)
    if problem:
        print(f"strata launch: warning: {problem}", file=sys.stderr, flush=True)
    status = env[STATUS_ENV] = tempfile.mkdtemp(prefix="strata-status-")  # 0700
    supervisor = Supervisor(
        preempted=functools.partial(workers_preempted, status, plan.nproc_per_node)
    )
    with supervisor.handling():
        keeper = None
        try:
            if plan.snapshots:
                agent, env[SOCKET_ENV] = start_agent(plan, env)
                keeper = AgentKeeper(plan, dict(env), agent, env[SOCKET_ENV])
                supervisor.watch = keeper.check
            if supervisor.pending:  # stopped while the agent was starting: start no workers
                return 128 + supervisor.pending[0]
            cmd = torchrun_command(plan, worker)
            print("strata launch:", shlex.join(cmd), flush=True)
            return supervisor.run(cmd, env)
        finally:
            if keeper is not None:
                keeper.stop()
            shutil.rmtree(status, ignore_errors=True)


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
