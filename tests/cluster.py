"""N simulated nodes on one machine for tests and benchmarks: each node is a network namespace with its
own hostname and address, joined to the others by a bridge in a "switch" namespace, with links that
can be rate-limited (tbf), cut, counted and whose processes can be killed. Needs root (CAP_NET_ADMIN).

    python -m tests.cluster up --nodes 2 --rate 200mbit   # prints the nodes as JSON, up until Ctrl-C
    python -m tests.cluster down                           # removes every namespace this harness made
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts NETNS_ETC/NS/* over /etc/*
OWNERS = Path("/run/strata-cluster")  # OWNERS/<prefix>: "pid starttime" of the process that made it
NAME = re.compile(r"^(st[0-9a-f]{8})-(n\d+|sw)$")  # every namespace this harness makes
NODE_IF, SWITCH_IF, BRIDGE = "eth0", "v{}", "br0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _operstate(netns: str, dev: str) -> str:
    return json.loads(_ip("-n", netns, "-j", "link", "show", dev).stdout)[0]["operstate"]


def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", netns, *args], capture_output=True, text=True, check=check)


@functools.cache
def unavailable() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    caps = next(
        (
            line.split()[1]
            for line in Path("/proc/self/status").read_text().splitlines()
            if "CapEff" in line
        ),
        "0",
    )
    if not int(caps, 16) & (1 << 12):
        return "needs CAP_NET_ADMIN"
    probe = f"stprobe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        veth = _ip(
            "-n",
            probe,
            "link",
            "add",
            "name",
            "a",
            "type",
            "veth",
            "peer",
            "name",
            "b",
            check=False,
        )
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
        tbf = _tc(
            probe,
            "qdisc",
            "add",
            "dev",
            "a",
            "root",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "32kb",
            "latency",
            "50ms",
        )
        if tbf.returncode != 0:
            return f"no tbf qdisc: {tbf.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def rate_bits(rate: str) -> int:
    """tc's rate (e.g. 200mbit, 1gbit, 500kbit) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)?", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write it as e.g. 200mbit, 1gbit or 500kbit")
    return int(float(m[1]) * {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[m[2] or "bit"])


@dataclass(frozen=True)
class Node:
    """One simulated node: its namespace, hostname, address, and its end of the link to the switch."""

    index: int
    netns: str
    hostname: str
    address: str
    ifname: str


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(prefix: str) -> bool:
    try:
        pid, start = (OWNERS / prefix).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == start


def _namespaces() -> dict[str, list[str]]:
    """This harness's namespaces, by prefix."""
    found: dict[str, list[str]] = {}
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = NAME.match(line.split()[0]) if line.strip() else None
        if m:
            found.setdefault(m[1], []).append(m[0])
    return found


def _kill_netns(netns: str, timeout_s: float = 10) -> None:
    """SIGKILL every process in `netns` and wait until they are gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {netns} did not die after SIGKILL")
        time.sleep(
            0.02
        )  # a dead process (a zombie, too) has left the namespace: `ip netns pids` skips it


def _remove(prefix: str, names: list[str]) -> None:
    for netns in names:
        _kill_netns(netns)
    for netns in names:
        _ip("netns", "del", netns, check=False)
        shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    (OWNERS / prefix).unlink(missing_ok=True)


def remove_all(stale_only: bool = False) -> list[str]:
    """Remove this harness's namespaces (only those whose maker is dead with `stale_only`); returns them."""
    removed = []
    for line in _ip(
        "netns", "list", check=False
    ).stdout.splitlines():  # an `unavailable` probe's, if it died
        probe = re.match(r"^stprobe-(\d+)\b", line)
        if probe and (not stale_only or not Path(f"/proc/{probe[1]}").exists()):
            _ip("netns", "del", probe[0], check=False)
            removed.append(probe[0])
    for prefix, names in _namespaces().items():
        if not stale_only or not _owner_alive(prefix):
            _remove(prefix, names)
            removed += names
    for path in NETNS_ETC.glob("st*-*"):  # a dir whose namespace is gone
        m = NAME.match(path.name)
        if (
            m
            and not (Path("/run/netns") / path.name).exists()
            and (not stale_only or not _owner_alive(m[1]))
        ):
            shutil.rmtree(path, ignore_errors=True)
    return removed


class Cluster:
    """`nodes` namespaces named <prefix>-n<i> (hostname the same, address <subnet>.<i+1>) on one bridge;
    `rate` (tc's syntax, e.g. 200mbit) shapes every link both ways. A context manager; `start()` and
    `close()` otherwise (close is idempotent and also runs at interpreter exit)."""

    def __init__(
        self,
        nodes: int,
        rate: str | None = None,
        prefix: str | None = None,
        subnet: str | None = None,
    ):
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes {nodes}: 1..250")
        self.prefix = prefix or f"st{secrets.token_hex(4)}"
        if not NAME.match(f"{self.prefix}-sw"):
            raise ValueError(
                f"prefix {self.prefix!r}: 'st' and 8 hex digits, as remove_all finds them"
            )
        net = subnet or f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(256)}.0/24"
        base = net.split("/")[0].rsplit(".", 1)[0]
        self.switch = f"{self.prefix}-sw"
        self.nodes = [
            Node(i, f"{self.prefix}-n{i}", f"{self.prefix}-n{i}", f"{base}.{i + 1}", NODE_IF)
            for i in range(nodes)
        ]
        self.rate = rate
        self._started = self._closed = False

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Cluster:
        problem = unavailable()
        if problem:
            raise RuntimeError(f"cannot make a cluster here: {problem}")
        remove_all(stale_only=True)
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.prefix).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        self._started = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        sw = ["-n", self.switch]
        _ip(*sw, "link", "add", "name", BRIDGE, "type", "bridge")
        _ip(*sw, "link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{n.address} {n.hostname}\n" for n in self.nodes
        )
        for n in self.nodes:
            _ip("netns", "add", n.netns)
            etc = NETNS_ETC / n.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(n.hostname + "\n")
            port = SWITCH_IF.format(n.index)
            _ip(
                *sw,
                "link",
                "add",
                "name",
                port,
                "type",
                "veth",
                "peer",
                "name",
                n.ifname,
                "netns",
                n.netns,
            )
            _ip(*sw, "link", "set", port, "master", BRIDGE, "up")
            _ip("-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.ifname)
            _ip("-n", n.netns, "link", "set", n.ifname, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
        self.shape(self.rate)

    def _links(self) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of every node's link."""
        return [
            end
            for n in self.nodes
            for end in ((n.netns, n.ifname), (self.switch, SWITCH_IF.format(n.index)))
        ]

    def shape(self, rate: str | None) -> None:
        """Limit every link to `rate` in both directions (tbf), or remove the limit (None)."""
        self.rate = rate
        for netns, dev in self._links():
            _tc(netns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is None:
                continue
            per_s = rate_bits(rate) // 8
            # A burst of 10 ms at the rate (at least 64 KiB, a whole TSO segment: a smaller bucket
            # drops or splits them and the link runs well below the rate); 100 ms of queue.
            burst = max(64 * 1024, per_s // 100)
            _tc(
                netns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                "100ms",
            )

    def set_link(self, node: int, up: bool, timeout_s: float = 10) -> None:
        """Cut (`up=False`) or restore node `node`'s link to the switch. A restore returns once both
        ends carry traffic, with every node's neighbour table emptied: an address lookup still being
        retried from while the link was cut would otherwise fail a new connection ("No route to
        host") when its last retry, sent before the restore, goes unanswered."""
        port = SWITCH_IF.format(node)
        _ip("-n", self.switch, "link", "set", port, "up" if up else "down")
        if not up:
            return
        ends = [(self.switch, port), (self.nodes[node].netns, self.nodes[node].ifname)]
        deadline = time.monotonic() + timeout_s
        while any(_operstate(ns, dev) != "UP" for ns, dev in ends):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node}'s link is not up {timeout_s} s after restoring it")
            time.sleep(0.01)
        for n in self.nodes:
            _ip("-n", n.netns, "neigh", "flush", "all")

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """Per node: (bytes sent, bytes received) on its link, as the node's interface counts them."""
        counts = {}
        for n in self.nodes:
            stats = json.loads(_ip("-n", n.netns, "-s", "-j", "link", "show", n.ifname).stdout)[0][
                "stats64"
            ]
            counts[n.index] = (stats["tx"]["bytes"], stats["rx"]["bytes"])
        return counts

    def command(self, node: int, cmd: list[str]) -> list[str]:
        """`cmd` as run inside node `node` (its network, and a UTS namespace with its hostname)."""
        n = self.nodes[node]
        wrap = [
            "ip",
            "netns",
            "exec",
            n.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
        ]
        return [*wrap, n.hostname, *cmd]

    def popen(
        self, node: int, cmd: list[str], env: dict[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, cmd), env=env, **kwargs)

    def run(self, node: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, cmd), **kwargs)

    def torchrun(
        self, nproc: int, target: list[str], env: dict[str, str], timeout_s: float, cwd: Path
    ) -> None:
        """`target` (a script and its arguments, or -m MODULE ...) under torchrun on every node:
        static rendezvous at node 0's address, gloo on each node's own interface, one
        thread per rank; a module's workers are forks of the node's fork server, as `strata
        launch` starts them. RuntimeError with each node's output tail if a node's torchrun fails."""
        from strata.net import free_port

        port = free_port()
        procs = []
        runner = "strata.launch.elastic" if target[:1] == ["-m"] else "torch.distributed.run"
        for n in self.nodes:
            node_env = dict(
                env, GLOO_SOCKET_IFNAME=n.ifname, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"
            )
            cmd = [sys.executable, "-m", runner, "--nnodes", str(len(self.nodes))]
            cmd += ["--nproc-per-node", str(nproc), "--node-rank", str(n.index)]
            cmd += ["--master-addr", self.nodes[0].address, "--master-port", str(port), *target]
            out = subprocess.PIPE
            procs.append(
                self.popen(
                    n.index, cmd, env=node_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
                )
            )
        try:
            outs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
        except subprocess.TimeoutExpired:
            outs = ["(timed out)"] * len(procs)
        finally:
            for p in procs:
                p.kill()
        codes = [p.wait() for p in procs]
        if any(codes):
            tail = "\n".join(
                f"--- node {i} (exit {c}) ---\n{o[-3000:]}"
                for i, (c, o) in enumerate(zip(codes, outs))
            )
            raise RuntimeError(f"a node's torchrun failed: exit codes {codes}\n{tail}")

    def kill_node(self, node: int) -> None:
        """SIGKILL every process in node `node` and wait until they are gone."""
        _kill_netns(self.nodes[node].netns)

    def close(self) -> None:
        """Kill every process in every node, remove the namespaces and their /etc/netns files."""
        if self._closed or not self._started:
            return
        self._closed = True
        atexit.unregister(self.close)
        _remove(self.prefix, [n.netns for n in self.nodes] + [self.switch])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.cluster", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser(
        "up", help="make a cluster, print its nodes as JSON, keep it until SIGINT/SIGTERM"
    )
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--rate", help="tc rate of every link, e.g. 200mbit (default: unshaped)")
    sub.add_parser("down", help="remove every namespace this harness made")
    args = p.parse_args(argv)
    if args.action == "down":
        print("\n".join(remove_all()) or "nothing to remove")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Cluster(args.nodes, args.rate) as cluster:
        print(json.dumps([asdict(n) for n in cluster.nodes], indent=1), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
