"""Real faults on one machine with 2 nodes: a standalone rendezvous store and, per node, a `strata
launch` (torchrun with 2 workers, elastic restarts, c10d rendezvous) plus its snapshot agent. The
nodes are processes on the loopback, or (`netns`) network namespaces of the cluster harness
(tests/cluster.py), each with its own address, hostname and link, where a node loss kills every
process in its namespace and a partition takes its link down. The model is an MoE with its experts
split over the 4 ranks (expert parallelism across both nodes, so every rank holds state no other
rank has). Every run must end on the final parameters, router biases and optimizer state of an
uninterrupted run, bit for bit, and log where it resumed from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.net import free_port

from cluster import Cluster as Namespaces
from conftest import netns, tiny_overrides
from worlds import kill_marked, marked_processes, start, start_strata, strata_command

pytestmark = pytest.mark.slow  # multi-node worlds with snapshot agents, killed and restarted

STEPS = 40
SETTINGS = {
    "log.interval": 1,
    "train.steps": STEPS,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "checkpoint.interval": 10,
    "checkpoint.keep_last": 0,
    "checkpoint.save_final": True,
    "snapshot.every_steps": 1,
    "snapshot.k": 1,
    "snapshot.m": 1,
    "parallel.timeout_s": 20,
    # An MoE model with its experts split over the 4 ranks of the 2 nodes and a balancing bias, each
    # sequence split over 2 context-parallel ranks: a restored rank must get back its own experts,
    # their optimizer state and the router biases, and rejoin its context-parallel ring
    "parallel.cp": 2,
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.expert_ffn": 32,
    "model.moe.router": "sigmoid",
    "model.moe.bias_update_rate": 0.01,
    "parallel.ep": 4,
}
DEADLINE_S = 150


class Cluster:
    """A store and named nodes, each a `strata launch` whose output goes to a log file: processes on
    the loopback, or, with `namespaces`, each in a namespace of its own (the store in the first)."""

    def __init__(self, tmp: Path, data_dir: Path, namespaces: Namespaces | None = None, **settings):
        self.tmp, self.marker, self.namespaces = tmp, uuid.uuid4().hex, namespaces
        self.port = free_port()
        experiment = tmp / "experiment.yaml"
        experiment.write_text("{}\n")
        self.args = [
            str(experiment),
            *tiny_overrides(data_dir, tmp / "runs", **{**SETTINGS, **settings}),
        ]
        self.env = {"STRATA_SNAPSHOT_SECRET": os.urandom(32).hex()}
        self.where: dict[str, int] = {}  # node name -> namespace index
        self.host = namespaces.nodes[0].address if namespaces else "127.0.0.1"
        self.store = self._spawn("store", ["store", "--host", self.host, "--port", str(self.port)])
        self.nodes: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log, env = self.tmp / f"{name}.log", {**self.env, "STRATA_TEST_NODE": name}
        if self.namespaces is None:
            return start_strata(*args, marker=self.marker, log=log, env=env)
        self.where[name] = len(self.where)
        return start(
            self.namespaces.command(self.where[name], strata_command(*args)),
            marker=self.marker,
            log=log,
            env=env,
        )

    def start_node(self, name: str) -> None:
        flags = ["--net-ifname", self.namespaces.nodes[0].ifname] if self.namespaces else []
        self.nodes[name] = self._spawn(
            name,
            [
                "launch",
                *self.args,
                "--nproc",
                "2",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                f"{self.host}:{self.port}",
                "--rdzv-store",
                "external",
                "--rdzv-id",
                "faults",
                "--max-restarts",
                "3",
                "--join-timeout",
                "30",
                *flags,
            ],
        )

    def kill_node(self, name: str) -> None:
        """SIGKILL a node's launcher, agent, torchrun and workers (in a namespace: every process in it)."""
        if self.namespaces is not None:
            self.namespaces.kill_node(self.where[name])
        else:
            kill_marked(self.marker, STRATA_TEST_NODE=name)
        self.nodes[name].wait()

    def partition(self, name: str, seconds: float) -> None:
        """Take the node's link down for `seconds`, then up again."""
        assert self.namespaces is not None  # only namespaced nodes have links
        self.namespaces.set_link(self.where[name], False)
        time.sleep(seconds)
        self.namespaces.set_link(self.where[name], True)

    def kill_worker(self, rank: int) -> None:
        pids = marked_processes(self.marker, RANK=str(rank))
        assert len(pids) == 1, f"expected one worker with RANK={rank}, found {pids}"
        kill_marked(self.marker, RANK=str(rank))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def losses(self) -> list[tuple[int, float]]:
        """Every (step, loss) rank 0 logged, replayed steps included, in order."""
        path = self.tmp / "runs" / "t" / "metrics.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not any(s >= step for s, _ in self.losses()):
            self._check(deadline, f"step {step}")
            time.sleep(0.05)

    def wait(self, names: list[str]) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while any(self.nodes[n].poll() is None for n in names):
            self._check(deadline, "the end of the run")
            time.sleep(0.1)
        for n in names:  # every node's log: a node's failure is often another's doing
            logs = "\n".join(f"--- {m}\n{self.log(m)[-4000:]}" for m in self.nodes)
            assert self.nodes[n].returncode == 0, f"node {n} failed:\n{logs}"

    def _check(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{self.log(n)[-4000:]}" for n in self.nodes)
            pytest.fail(f"no {what} within {DEADLINE_S}s:\n{logs}")

    def close(self) -> None:
        kill_marked(self.marker)


@pytest.fixture
def cluster(tmp_path, small_data_dir):
    made = []

    def make(**settings) -> Cluster:
        made.append(Cluster(tmp_path, small_data_dir, **settings))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def running(cluster):
    """A 2-node job past step 12: its step-10 checkpoint committed and snapshots in the agents."""

    def start() -> Cluster:
        c = cluster()
        c.start_node("A")
        c.start_node("B")
        c.wait_for_step(12)
        return c

    return start


def final_state(tmp: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(store.step_dir(tmp / "runs" / "t" / "checkpoints", STEPS))
    try:
        return {
            **{f"model.{k}": v for k, v in ckpt.tensors("model.").items()},
            **{f"optim.{k}": v for k, v in ckpt.tensors("optim.").items()},
        }
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data_dir):
    """The same 2-node job, uninterrupted: its losses and final state."""
    tmp = tmp_path_factory.mktemp("reference")
    c = Cluster(tmp, small_data_dir)
    try:
        c.start_node("A")
        c.start_node("B")
        c.wait(["A", "B"])
        return dict(c.losses()), final_state(tmp)
    finally:
        c.close()


def assert_identical(c: Cluster, reference) -> None:
    losses, state = reference
    got = c.losses()
    assert {s for s, _ in got} == set(losses)
    for step, loss in got:
        assert loss == losses[step], f"step {step}: loss {loss} != {losses[step]} uninterrupted"
    final = final_state(c.tmp)
    assert final.keys() == state.keys()
    for key, want in state.items():
        assert torch.equal(final[key], want), key


def test_worker_kill_recovers_from_memory(running, reference):
    c = running()
    c.kill_worker(rank=1)
    c.wait(["A", "B"])
    log = c.log("A") + c.log("B")
    assert "snapshot: resumed from in-memory step" in log, log[-6000:]
    assert (
        "local" in log and "copied from agent" in log
    )  # own ranks from the own agent, the others' from theirs
    assert_identical(c, reference)


def test_losing_more_nodes_than_m_falls_back_to_the_disk_checkpoint(running, reference):
    c = running()
    c.kill_node("A")
    c.kill_node("B")
    c.start_node("C")
    c.start_node("D")
    c.wait(["C", "D"])
    log = c.log("C") + c.log("D")
    assert (
        "snapshot: no in-memory snapshot every rank can restore (no snapshot in any agent's memory); "
        "resumed from disk checkpoint"
    ) in log, log[-6000:]
    assert "step_00000010" in log
    assert_identical(c, reference)


def test_a_stopped_worker_is_named_and_the_restart_resumes_from_memory(cluster, reference):
    c = cluster(**{"parallel.hang_timeout_s": 3})
    c.start_node("A")
    c.start_node("B")
    c.wait_for_step(12)
    pids = marked_processes(c.marker, RANK="1")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGSTOP)  # alive but frozen: no error reaches torchrun, only silence
    c.wait(["A", "B"])
    log = c.log("A") + c.log("B")
    assert f"hang: rank 1 (host {os.uname().nodename}, pid {pids[0]}; last collective:" in log, log[
        -6000:
    ]
    assert "is not responding (stopped, frozen or gone)" in log
    assert "snapshot: resumed from in-memory step" in log, log[-6000:]
    assert_identical(c, reference)


@pytest.fixture
def namespaces():
    with Namespaces(4) as made:  # the store's, A's, B's, and a fresh node's
        yield made


@pytest.fixture
def real_nodes():
    """Namespaces for the store, A, B and a fresh node where they can be made; None (the nodes are
    processes on the loopback) where they cannot, unless STRATA_REQUIRE_NETNS=1 makes that a failure."""
    from cluster import unavailable

    problem = unavailable()
    if problem and os.environ.get("STRATA_REQUIRE_NETNS") == "1":
        pytest.fail(f"STRATA_REQUIRE_NETNS=1 but network namespaces cannot be made here: {problem}")
    if problem:
        yield None
        return
    with Namespaces(4) as made:
        yield made


def test_a_killed_node_is_rebuilt_from_fragments_on_a_fresh_one(
    tmp_path, small_data_dir, real_nodes, reference
):
    """Every process of node B (launcher, torchrun, workers, snapshot agent; on real nodes, all of
    its namespace) is killed; a fresh node C (with its own address on real nodes) joins, and B's
    ranks are rebuilt from the fragments A's agent holds."""
    c = Cluster(tmp_path, small_data_dir, real_nodes)
    try:
        c.start_node("A")
        c.start_node("B")
        c.wait_for_step(12)
        c.kill_node("B")
        c.start_node("C")
        c.wait(["A", "C"])
        log = c.log(
            "A"
        )  # rank 0 is on A, whichever ranks A's workers had before (the rendezvous may reorder)
        assert "snapshot: resumed from in-memory step" in log, log[-6000:]
        assert "–" in log and "rebuilt from fragments [1]" in log, log[
            -6000:
        ]  # B's 2 ranks, from A's fragments
        assert_identical(c, reference)
    finally:
        c.close()


@netns
def test_a_partitioned_node_ends_in_recovery_or_one_clear_error_never_a_hang(
    tmp_path, small_data_dir, namespaces, reference
):
    """Node B's link goes down for longer than the collective timeout (and the hang timeout), then
    comes back: the job either recovers from memory and ends on the uninterrupted run's state, or
    stops with one clear error, within a bounded time; it never hangs."""
    timeout_s = 12  # the partition outlasts the collective timeout by 5 s
    c = Cluster(
        tmp_path,
        small_data_dir,
        namespaces,
        **{"parallel.hang_timeout_s": 4, "parallel.timeout_s": timeout_s},
    )
    try:
        c.start_node("A")
        c.start_node("B")
        c.wait_for_step(12)
        started = time.monotonic()
        c.partition("B", seconds=timeout_s + 5)
        deadline = started + DEADLINE_S
        while any(p.poll() is None for p in c.nodes.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = {n: p.poll() for n, p in c.nodes.items()}
        logs = "\n".join(f"--- {n}\n{c.log(n)[-4000:]}" for n in c.nodes)
        assert None not in codes.values(), (
            f"still running {DEADLINE_S}s after the partition:\n{logs}"
        )
        if codes == {"A": 0, "B": 0}:
            assert "resumed from" in c.log("A"), logs
            assert_identical(c, reference)
        else:
            assert "hang: rank" in logs or "rendezvous" in logs, logs
    finally:
        c.close()
