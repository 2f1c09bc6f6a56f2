"""The multi-node harness (tests/cluster.py) on real network namespaces: shaped bandwidth, byte
counters, hostnames, node kills, partitions and cleanup; and `strata launch` across its nodes (c10d,
static and external-store rendezvous) ending where a loopback run of the same layout ends.

Needs root with CAP_NET_ADMIN; skipped without it, except where STRATA_REQUIRE_NETNS=1 (CI) makes a
missing capability a failure."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.launch.torchrun import (
    LaunchPlan,
    check_plan,
    interface_problem,
    launch_env,
    rdzv_is_host,
    torchrun_args,
)

from cluster import NODE_IF, Cluster
from conftest import netns, tiny_overrides
from worlds import REPO, strata_command

PORT = 5201

# Receives one connection until EOF; prints the bytes and the seconds from the first to the last byte.
SINK = """
import json, socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
got, first = 0, None
while data := c.recv(1 << 20):
    first = first or time.perf_counter()
    got += len(data)
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - first}), flush=True)
"""
# Sends argv[3] bytes to argv[1]:argv[2].
SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
block, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    c.sendall(block[: min(left, len(block))])
    left -= len(block)
c.close()
"""


def _transfer(
    cluster: Cluster, nbytes: int, src: int = 0, dst: int = 1, timeout_s: float = 30
) -> dict:
    """Send `nbytes` over TCP from node `src` to node `dst`; the receiver's count and seconds."""
    sink = cluster.popen(
        dst, [sys.executable, "-c", SINK, str(PORT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout.readline().strip() == "ready"
        address = cluster.nodes[dst].address
        cluster.run(
            src,
            [sys.executable, "-c", SOURCE, address, str(PORT), str(nbytes), "10"],
            check=True,
            timeout=60,
        )
        out, _ = sink.communicate(timeout=timeout_s)
    finally:
        sink.kill()
        sink.wait()
    return json.loads(out)


def _netns_names() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@netns
def test_shaped_bandwidth_and_byte_counts():
    with Cluster(2, rate="200mbit") as cluster:
        before = cluster.link_bytes()
        nbytes = 12_500_000  # half a second at 200 Mbit/s
        done = _transfer(cluster, nbytes)
        after = cluster.link_bytes()
        assert done["bytes"] == nbytes
        rate = nbytes * 8 / done["seconds"]
        assert 0.80 * 200e6 <= rate <= 1.05 * 200e6, f"{rate / 1e6:.0f} Mbit/s"
        sent, received = after[0][0] - before[0][0], after[1][1] - before[1][1]
        assert nbytes <= sent <= 1.05 * nbytes and nbytes <= received <= 1.05 * nbytes, (
            sent,
            received,
        )

        cluster.shape(None)
        done = _transfer(cluster, 4 * nbytes)
        assert 4 * nbytes * 8 / done["seconds"] > 3 * 200e6  # unshaped: veth speed


@netns
def test_each_node_has_its_own_hostname_and_resolves_the_others():
    probe = (
        "import json, socket, sys; "
        "print(json.dumps([socket.gethostname(), socket.getfqdn(), *map(socket.gethostbyname, sys.argv[1:])]))"
    )
    with Cluster(3) as cluster:
        names = [n.hostname for n in cluster.nodes]
        for n in cluster.nodes:
            done = cluster.run(
                n.index,
                [sys.executable, "-c", probe, *names],
                capture_output=True,
                text=True,
                check=True,
            )
            host, fqdn, *addresses = json.loads(done.stdout)
            assert host == fqdn == n.hostname
            assert addresses == [m.address for m in cluster.nodes]


@netns
def test_kill_node_kills_only_that_node():
    with Cluster(2) as cluster:
        procs = [cluster.popen(i, ["sleep", "600"]) for i in (0, 0, 1)]
        grandchild = cluster.popen(0, ["sh", "-c", "sleep 600 & wait"])
        time.sleep(0.3)
        cluster.kill_node(0)
        assert [p.wait(5) for p in procs[:2]] == [-9, -9] and grandchild.wait(5) == -9
        assert (
            subprocess.run(
                ["ip", "netns", "pids", cluster.nodes[0].netns], capture_output=True
            ).stdout
            == b""
        )
        assert procs[2].poll() is None
        cluster.kill_node(1)
        assert procs[2].wait(5) == -9


@netns
def test_a_cut_link_refuses_connections_until_restored():
    with Cluster(2) as cluster:
        cluster.set_link(1, up=False)
        # The attempt gives up at 2.2 s: after the address lookup's last retry (the kernel's default
        # 3 tries, 1 s apart) and before that lookup fails, so the restore lands while it is pending.
        refused = cluster.run(
            0,
            [sys.executable, "-c", SOURCE, cluster.nodes[1].address, str(PORT), "1", "2.2"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert refused.returncode != 0 and (
            "timed out" in refused.stderr or "No route" in refused.stderr
        )
        cluster.set_link(1, up=True)
        assert _transfer(cluster, 1_000_000)["bytes"] == 1_000_000


@netns
def test_close_leaves_nothing_behind_even_after_an_error():
    with pytest.raises(RuntimeError, match="inside"):
        with Cluster(2) as cluster:
            cluster.popen(1, ["sleep", "600"])
            names = [n.netns for n in cluster.nodes] + [cluster.switch]
            assert set(names) <= set(_netns_names())
            raise RuntimeError("inside")
    assert not set(names) & set(_netns_names())
    assert not any((Path("/etc/netns") / name).exists() for name in names)
    cluster.close()  # idempotent


@netns
def test_a_dead_makers_namespaces_are_removed_by_the_next_cluster():
    maker = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; sys.path.insert(0, sys.argv[1]); from tests.cluster import Cluster; "
            "c = Cluster(1).start(); print(c.prefix, flush=True); os._exit(0)",
            str(REPO),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    prefix = maker.stdout.strip()
    assert f"{prefix}-n0" in _netns_names()  # os._exit: no atexit, as after a crash
    with Cluster(1):
        assert not any(name.startswith(prefix) for name in _netns_names())


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_static_rendezvous_flags_and_their_errors():
    plan = LaunchPlan(
        2, nnodes=2, node_rank=1, master_addr="203.0.113.7", master_port=29511, join_timeout_s=30
    )
    args = torchrun_args(plan)
    assert (
        _flag(args, "--node-rank"),
        _flag(args, "--master-addr"),
        _flag(args, "--master-port"),
    ) == (
        "1",
        "203.0.113.7",
        "29511",
    )
    assert (
        "--rdzv-backend" not in args
        and "--rdzv-endpoint" not in args
        and _flag(args, "--max-restarts") == "0"
    )
    assert (
        _flag(torchrun_args(LaunchPlan(1, node_rank=0, master_addr="n0")), "--master-port")
        == "29500"
    )
    for plan, message in (
        (
            LaunchPlan(1, nnodes=2, node_rank=2, master_addr="n0"),
            r"--node-rank 2: must be 0\.\.1 with --nnodes 2",
        ),
        (LaunchPlan(1, nnodes=2, node_rank=0), "needs --master-addr HOST"),
        (LaunchPlan(1, nnodes=2, master_addr="n0"), "needs --node-rank R"),
        (
            LaunchPlan(1, nnodes=2, node_rank=0, master_addr="n0", rdzv_endpoint="n0:1"),
            "give one of them",
        ),
        (
            LaunchPlan(1, nnodes=2, node_rank=0, master_addr="n0", external_store=True),
            "--rdzv-store external hosts a c10d rendezvous",
        ),
        (
            LaunchPlan(1, nnodes=2, node_rank=0, master_addr="n0", max_restarts=1),
            "--max-restarts 1 needs a c10d",
        ),
        (LaunchPlan(1, nnodes=2, node_rank=0, master_addr="n0", master_port=0), "--master-port 0"),
        (LaunchPlan(2), None),
    ):
        if message is None:
            check_plan(plan)
            continue
        with pytest.raises(StrataError, match=message):
            check_plan(plan)
    with pytest.raises(
        StrataError, match="--node-rank R --master-addr HOST"
    ):  # named where nodes cannot meet
        check_plan(LaunchPlan(1, nnodes=2))


def test_net_ifname_sets_the_workers_interface_and_must_exist(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "from-env")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = launch_env(LaunchPlan(1))
    assert (
        env["GLOO_SOCKET_IFNAME"] == "from-env" and "NCCL_SOCKET_IFNAME" not in env
    )  # passes through
    env = launch_env(LaunchPlan(1, net_ifname="lo"))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    check_plan(LaunchPlan(1, net_ifname="lo"))
    with pytest.raises(
        StrataError,
        match=r"--net-ifname 'nosuch0': this node has no such interface; it has .*\blo\b",
    ):
        check_plan(LaunchPlan(1, net_ifname="nosuch0"))


def test_a_loopback_hostname_without_an_interface_is_warned_about(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    plan = LaunchPlan(1, nnodes=2, rdzv_endpoint="203.0.113.7:29400")
    assert "add --net-ifname IF" in interface_problem(plan, {})
    assert interface_problem(plan, {"GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert (
        interface_problem(
            LaunchPlan(1, nnodes=2, rdzv_endpoint="203.0.113.7:29400", net_ifname="lo"), {}
        )
        is None
    )
    assert interface_problem(LaunchPlan(1), {}) is None  # one node: loopback is right


def test_who_hosts_the_rendezvous_store_off_the_loopback():
    assert (
        rdzv_is_host("127.0.0.1:29400") is None and rdzv_is_host("localhost:29400") is None
    )  # torch's guess
    assert rdzv_is_host("203.0.113.7:29400") is False  # not an address of this machine
    assert rdzv_is_host("no-such-host.invalid:29400") is False
    assert rdzv_is_host("127.0.0.1:29400", external_store=True) is False  # `strata store` hosts it
    conf = _flag(
        torchrun_args(LaunchPlan(1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")), "--rdzv-conf"
    )
    assert "is_host" not in conf


# In a node: is_host for its own address (a free port, a taken one), its own name, another node's address.
IS_HOST = """
import json, socket, sys
from strata.launch.torchrun import rdzv_is_host
own, name, other = sys.argv[1:]
free = rdzv_is_host(f"{own}:29400")
with socket.create_server((own, 29400)):
    taken = rdzv_is_host(f"{own}:29400")
print(json.dumps([free, taken, rdzv_is_host(f"{name}:29400"), rdzv_is_host(f"{other}:29400"), rdzv_is_host(own)]))
"""


@netns
def test_who_hosts_the_rendezvous_store_between_nodes():
    with Cluster(2) as cluster:
        n0, n1 = cluster.nodes
        done = cluster.run(
            0,
            [sys.executable, "-c", IS_HOST, n0.address, n0.hostname, n1.address],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [True, False, True, False, True]


# --- `strata launch` across nodes ------------------------------------------------------------------------

LAUNCH_SETTINGS = {
    "log.interval": 1,
    "train.steps": 3,
    "checkpoint.save_final": True,
    "parallel.timeout_s": 30,
}
LAUNCH_WAIT_S = 150


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, small_data_dir) -> dict[int, float]:
    """The same run in one process (the same global batch): where every layout must end."""
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    cfg = tiny_config(small_data_dir, tmp_path_factory.mktemp("reference"), **LAUNCH_SETTINGS)
    return {step: float(loss) for step, loss in run(cfg, start()).losses.items()}


def _debian_hosts(cluster: Cluster) -> None:
    """Each node's own hostname on 127.0.1.1, as Debian writes it; the others' on their addresses (as DNS
    would give them): torch's guesses of who hosts the store and which address the workers use go wrong."""
    for n in cluster.nodes:
        others = "".join(f"{m.address} {m.hostname}\n" for m in cluster.nodes if m is not n)
        (Path("/etc/netns") / n.netns / "hosts").write_text(
            f"127.0.0.1 localhost\n127.0.1.1 {n.hostname}\n{others}"
        )


def _launch_on_nodes(tmp: Path, data_dir: Path, mode: str, nproc: int) -> dict[int, float]:
    """`strata launch` on each of 2 nodes (rendezvous `mode`: c10d, static or external); rank 0's losses."""
    experiment = tmp / "experiment.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(data_dir, tmp / "runs", **LAUNCH_SETTINGS)
    with Cluster(2) as cluster:
        _debian_hosts(cluster)
        head = cluster.nodes[0].address
        procs, logs = [], []

        def start(node: int, name: str, args: list[str]) -> None:
            log = tmp / f"{name}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    cluster.popen(
                        node, strata_command(*args), cwd=REPO, stdout=out, stderr=subprocess.STDOUT
                    )
                )

        flags = [
            "--nnodes",
            "2",
            "--nproc",
            str(nproc),
            "--join-timeout",
            "60",
            "--net-ifname",
            NODE_IF,
        ]
        if mode == "external":
            start(0, "store", ["store", "--port", "29400"])
            deadline = time.monotonic() + 30
            while "rendezvous store at" not in logs[0].read_text():
                assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()
                time.sleep(0.1)
            flags += ["--rdzv-store", "external", "--rdzv-endpoint", f"{head}:29400"]
        elif mode == "c10d":
            flags += ["--rdzv-endpoint", f"{head}:29400"]
        launchers = []
        for n in cluster.nodes:
            node_flags = (
                ["--node-rank", str(n.index), "--master-addr", head] if mode == "static" else []
            )
            start(
                n.index,
                f"node{n.index}",
                ["launch", str(experiment), *overrides, *flags, *node_flags],
            )
            launchers.append(procs[-1])
        try:
            codes = [p.wait(LAUNCH_WAIT_S) for p in launchers]
        except subprocess.TimeoutExpired:
            codes = None
        tails = "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs
        )
        assert codes == [0, 0], tails
    return losses_from(tmp / "runs" / "t")


def losses_from(run_dir: Path) -> dict[int, float]:
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@netns
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "nproc"), [("c10d", 2), ("static", 1), ("external", 1)])
def test_launch_across_nodes_ends_where_one_process_does(
    tmp_path, small_data_dir, reference_losses, mode, nproc
):
    """2 nodes whose own hostnames resolve to 127.0.1.1 (Debian's default), each `strata launch
    --net-ifname eth0`: a c10d rendezvous at node 0's address, a static one, and one in a `strata
    store` on node 0 all train, and log the losses of one process with the same global batch."""
    losses = _launch_on_nodes(tmp_path, small_data_dir, mode, nproc)
    assert sorted(losses) == sorted(reference_losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-5), step
