"""Workers forked from the fork server (`strata launch --worker-start forkserver`, the default)
against the same command started as torchrun starts one (subprocess.Popen in a new session): the
same arguments, environment (also as /proc shows them), session, parent, descriptors, signal
handlers and exit status, a signal's included; a worker the server must not fork starts fresh; and
a real 2-worker launch whose killed worker is restarted from the fork server ends on the same
parameters and optimizer state as an uninterrupted run of fresh workers, bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.errors import StrataError
from strata.launch.elastic import (
    AdoptedWorker,
    ForkServer,
    install_rendezvous_poll,
    rendezvous_poll_s,
)
from strata.launch.torchrun import LaunchPlan, WorkerCommand, torchrun_command

from conftest import tiny_overrides
from worlds import kill_marked, marked_processes, start_strata

PROBE = r"""
import json, os, signal, sys, time
from pathlib import Path

def proc(name):
    return [x.decode() for x in Path(f"/proc/self/{name}").read_bytes().split(b"\0") if x]

report = {
    "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "cwd": os.getcwd(), "path": sys.path,
    "spec": __spec__.name,
    "environ": dict(os.environ), "proc_environ": proc("environ"), "proc_cmdline": proc("cmdline"),
    "session_leader": os.getsid(0) == os.getpid(), "group_leader": os.getpgid(0) == os.getpid(),
    "parent": os.getppid(), "fds": sorted(os.listdir("/proc/self/fd")), "write_through": sys.stdout.write_through,
    "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                              signal.SIGUSR1, signal.SIGPIPE)},
    "threads": len(os.listdir("/proc/self/task")),
}
print(json.dumps(report), flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """The `python -u -m probe ARG` command (a module on PYTHONPATH, set before the server starts)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))
    return lambda arg: [sys.executable, "-u", "-m", "probe", arg]


@pytest.fixture
def server():
    made = ForkServer(
        preload=["json"]
    )  # a light server: these tests are about the process, not the imports
    yield made
    made.close()


def worker_env(rank: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "TORCHELASTIC_RESTART_COUNT": "1",
    }


def fresh(argv: list[str], env: dict[str, str], out) -> subprocess.Popen:
    """What torch.distributed.elastic's SubprocessHandler does."""
    return subprocess.Popen(argv, env=env, stdout=out, start_new_session=True)


def report(path: Path) -> dict:
    deadline = time.monotonic() + 30
    while not path.read_text().strip():
        assert time.monotonic() < deadline, "the worker wrote nothing"
        time.sleep(0.01)
    got = json.loads(path.read_text().splitlines()[0])
    got["proc_environ"] = dict(item.split("=", 1) for item in got["proc_environ"])
    return got


def test_a_forked_worker_is_the_process_torchrun_would_have_started(tmp_path, probe, server):
    env = worker_env(1)
    with open(tmp_path / "forked.out", "w") as out:
        worker = server.spawn(probe("7"), env, (0, out.fileno(), 2))
    assert isinstance(worker, AdoptedWorker)
    with open(tmp_path / "fresh.out", "w") as out:
        reference = fresh(probe("7"), env, out)
    assert worker.wait(30) == reference.wait(30) == 7
    forked, want = report(tmp_path / "forked.out"), report(tmp_path / "fresh.out")
    assert forked["argv"][1:] == ["7"] and forked["proc_environ"]["RANK"] == "1"
    assert forked["parent"] == want["parent"] == os.getpid()  # adopted: this process waits for it
    assert forked == want


def wait_for_state(pid: int, state: str) -> bool:
    """Whether /proc shows `pid` in `state` (T: stopped, S: sleeping) within 10 s."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != state:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_exit_status_signals_and_stops_are_the_workers_own(tmp_path, probe, server):
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGUSR1):
        codes = []
        for start in ("forked", "fresh"):
            out_path = tmp_path / f"{start}-{sig.name}.out"
            with open(out_path, "w") as out:
                if start == "forked":
                    worker = server.spawn(probe("wait"), worker_env(0), (0, out.fileno(), 2))
                else:
                    worker = fresh(probe("wait"), worker_env(0), out)
            report(out_path)  # running, handlers in place
            if sig == signal.SIGTERM:  # stopped and continued first, as a debugger or a hang would
                os.kill(worker.pid, signal.SIGSTOP)
                assert wait_for_state(worker.pid, "T")
                os.kill(worker.pid, signal.SIGCONT)
                assert wait_for_state(worker.pid, "S")
            os.killpg(worker.pid, sig)  # torchrun's way: the worker's session, its process group
            codes.append(worker.wait(30))
        assert codes[0] == codes[1], sig.name
        assert (
            codes[0] == -sig
        )  # SIGINT too: Python ends by SIGINT after an uncaught KeyboardInterrupt


def test_a_worker_the_server_must_not_fork_starts_fresh(tmp_path, probe, server, capsys):
    assert server.spawn(probe("0"), {**worker_env(0), "MY_SETTING": "changed"}, (0, 1, 2)) is None
    assert "its environment differs from the fork server's in MY_SETTING" in capsys.readouterr().err
    assert server.spawn(["/bin/true"], worker_env(0), (0, 1, 2)) is None  # not a `python -m` worker
    huge = {**worker_env(0), "RANK": "1" * 100_000}  # more than the room the server reserved
    assert server.spawn(probe("0"), huge, (0, 1, 2)) is None
    assert "does not fit the room" in capsys.readouterr().err
    worker = server.spawn(probe("0"), worker_env(0), (0, 1, 2))  # refusals leave it serving
    assert worker is not None and worker.wait(30) == 0
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait()
    assert server.spawn(probe("0"), worker_env(0), (0, 1, 2)) is None
    assert "the fork server" in capsys.readouterr().err
    assert (
        server.spawn(probe("0"), worker_env(0), (0, 1, 2)) is None
    )  # and stays off, without a second try


def test_a_server_started_before_torchrun_serves_workers_like_it_and_is_replaced_for_others(
    tmp_path, probe, monkeypatch, capsys
):
    """`start_early` (before torchrun's imports, from this process's environment): a worker whose
    environment is that one plus torchrun's per-worker variables is forked by it; a first worker
    whose environment torchrun changed meanwhile (OMP_NUM_THREADS) gets a server started anew."""
    torchrun_argv = ["--nproc-per-node", "1", "-m", "probe", "7"]
    early = ForkServer(preload=["json"])
    try:
        early.start_early(torchrun_argv)
        first = early.proc.pid
        with open(tmp_path / "forked.out", "w") as out:
            worker = early.spawn(probe("7"), worker_env(1), (0, out.fileno(), 2))
        assert isinstance(worker, AdoptedWorker) and worker.wait(30) == 7
        assert early.proc.pid == first
        assert report(tmp_path / "forked.out")["proc_environ"]["RANK"] == "1"
    finally:
        early.close()

    replaced = ForkServer(preload=["json"])
    try:
        replaced.start_early(torchrun_argv)
        first = replaced.proc.pid
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # as torchrun does after its imports
        with open(tmp_path / "replaced.out", "w") as out:
            worker = replaced.spawn(probe("0"), worker_env(0), (0, out.fileno(), 2))
        assert isinstance(worker, AdoptedWorker) and worker.wait(30) == 0
        assert replaced.proc.pid != first
        assert report(tmp_path / "replaced.out")["proc_environ"]["OMP_NUM_THREADS"] == "3"
        assert "fresh Python" not in capsys.readouterr().err
    finally:
        replaced.close()


def test_launch_runs_torchrun_with_the_fork_server_unless_told_not_to():
    endpoint = "127.0.0.1:29400"
    default = torchrun_command(LaunchPlan(2, rdzv_endpoint=endpoint), WorkerCommand("c.yaml"))
    assert default[1:3] == ["-m", "strata.launch.elastic"]
    plain = torchrun_command(
        LaunchPlan(2, rdzv_endpoint=endpoint, worker_start="fresh"), WorkerCommand("c.yaml")
    )
    assert plain[1:3] == ["-m", "torch.distributed.run"]
    assert default[3:] == plain[3:]  # the same torchrun flags and worker command otherwise
    with pytest.raises(
        StrataError, match="--worker-start 'spawn': must be one of forkserver, fresh"
    ):
        torchrun_command(LaunchPlan(2, worker_start="spawn"), WorkerCommand("c.yaml"))


def test_a_waiting_node_reads_the_rendezvous_state_more_often_than_once_a_second(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    holder = dynamic_rendezvous._BackendRendezvousStateHolder
    monkeypatch.setattr(
        dynamic_rendezvous, "_delay", dynamic_rendezvous._delay
    )  # put back afterwards
    monkeypatch.setattr(holder, "__init__", holder.__init__)
    assert install_rendezvous_poll(0.05)
    for asked, low, high in (
        (1, 0.04, 0.5),
        (0.3, 0.29, 0.8),
    ):  # the poll's 1 s, and any other delay as asked
        t0 = time.perf_counter()
        dynamic_rendezvous._delay(seconds=asked)
        assert low <= time.perf_counter() - t0 < high, asked
    # a state read stays fresh no longer than a poll: the holder rereads the store at the next one
    reads = []

    class Backend:
        name = "test"

        def get_state(self):
            reads.append(time.monotonic())
            return None

    settings = types.SimpleNamespace(
        keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=2
    )
    state = holder(Backend(), settings)
    state.sync()
    state.sync()  # within the poll: from the cache
    time.sleep(0.06)
    state.sync()
    assert len(reads) == 2
    assert (
        rendezvous_poll_s(2) < rendezvous_poll_s(8) < rendezvous_poll_s(1000) == 1.0
    )  # torch's for large jobs


# --- a real restart -------------------------------------------------------------------------------

STEPS = 30
SETTINGS = {
    "log.interval": 1,
    "train.steps": STEPS,
    "checkpoint.interval": 0,
    "checkpoint.save_final": True,
    "snapshot.every_steps": 1,
    "snapshot.k": 1,
    "snapshot.m": 0,
    "parallel.timeout_s": 30,
}


def launch(tmp: Path, data_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    experiment = tmp / "experiment.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(data_dir, tmp / "runs", **SETTINGS)
    proc = start_strata(
        "launch",
        str(experiment),
        "--nproc",
        "2",
        *flags,
        *overrides,
        marker=marker,
        log=tmp / "launch.log",
    )
    return proc, marker


def logged_steps(tmp: Path) -> list[int]:
    path = tmp / "runs" / "t" / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if "loss" in record:
            steps.append(record["step"])
    return steps


def final_state(tmp: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(store.step_dir(tmp / "runs" / "t" / "checkpoints", STEPS))
    try:
        return {
            **ckpt.tensors("model."),
            **{f"optim.{k}": v for k, v in ckpt.tensors("optim.").items()},
        }
    finally:
        ckpt.close()


def finish(proc: subprocess.Popen, marker: str, tmp: Path) -> str:
    try:
        code = proc.wait(150)
    finally:
        kill_marked(marker)
    log = (tmp / "launch.log").read_text(errors="replace")
    assert code == 0, log[-6000:]
    return log


@pytest.mark.slow  # two real 2-worker launches, one killed and restarted
def test_a_killed_worker_restarts_as_a_fork_and_ends_as_an_uninterrupted_fresh_run(
    tmp_path, small_data_dir
):
    ref_dir, run_dir = tmp_path / "fresh", tmp_path / "forked"
    ref_dir.mkdir()
    run_dir.mkdir()
    proc, marker = launch(ref_dir, small_data_dir, "--worker-start", "fresh")
    reference = finish(proc, marker, ref_dir)
    assert "fork server" not in reference

    proc, marker = launch(run_dir, small_data_dir, "--max-restarts", "1")
    deadline = time.monotonic() + 120
    while max(logged_steps(run_dir), default=0) < 10:
        assert proc.poll() is None and time.monotonic() < deadline, (
            run_dir / "launch.log"
        ).read_text()[-6000:]
        time.sleep(0.05)
    [victim] = marked_processes(
        marker, RANK="1"
    )  # the forked worker shows its own environment in /proc
    assert b"strata.launch.cli\0train\0" in Path(f"/proc/{victim}/cmdline").read_bytes()
    os.kill(victim, signal.SIGKILL)
    log = finish(proc, marker, run_dir)

    forked = {
        int(m[1]): (m[2], m[3])
        for m in re.finditer(r"worker pid (\d+) \(local rank (\d), restart (\d)\)", log)
    }
    assert sorted(forked.values()) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], log[-6000:]
    assert forked[victim] == ("1", "0")
    assert "snapshot: resumed from in-memory step" in log, log[-6000:]
    want, got = final_state(ref_dir), final_state(run_dir)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
