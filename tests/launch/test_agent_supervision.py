"""`strata launch` keeps the node's snapshot agent alive: an agent killed mid-run (SIGKILL, as the
OOM killer would) is restarted on the same socket, the workers reconnect at their next snapshot
without stopping training, snapshots succeed again within a few steps, and a worker killed after
that resumes from an in-memory snapshot the restarted agent took; an agent that keeps dying is
given up on, and training goes on without snapshots."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from strata.checkpoint.agent_protocol import connect, request
from strata.launch.torchrun import AgentKeeper, LaunchPlan, launch_env, start_agent

from conftest import tiny_overrides
from worlds import kill_marked, marked_processes, start_strata

DEADLINE_S = 150
AGENT_MODULE = b"strata.launch.snapshot_agent"


class Launch:
    """`strata launch` of the tiny model on 2 workers with snapshots every step, output to launch.log."""

    def __init__(self, tmp: Path, data_dir: Path, steps: int, *flags: str):
        self.tmp, self.marker = tmp, uuid.uuid4().hex
        experiment = tmp / "experiment.yaml"
        experiment.write_text("{}\n")
        settings = {
            "log.interval": 1,
            "train.steps": steps,
            "checkpoint.interval": 20,
            "snapshot.every_steps": 1,
            "snapshot.k": 1,
            "snapshot.m": 0,
            "parallel.timeout_s": 30,
        }
        overrides = tiny_overrides(data_dir, tmp / "runs", **settings)
        self.proc = start_strata(
            "launch",
            str(experiment),
            "--nproc",
            "2",
            *flags,
            *overrides,
            marker=self.marker,
            log=tmp / "launch.log",
        )

    def agents(self) -> list[int]:
        return [pid for pid in marked_processes(self.marker) if AGENT_MODULE in _cmdline(pid)]

    def records(self) -> list[dict]:
        """metrics.jsonl's records, each with the time the test first saw it ("seen")."""
        path = self.tmp / "runs" / "t" / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                break
        return out

    def log(self) -> str:
        return (self.tmp / "launch.log").read_text(errors="replace")

    def wait_until(self, condition, what: str) -> float:
        """The monotonic time `condition()` first held (polled every 20 ms)."""
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"no {what} (launcher exit {self.proc.poll()}):\n{self.log()[-6000:]}")
            time.sleep(0.02)
        return time.monotonic()

    def close(self) -> None:
        kill_marked(self.marker)
        self.proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _snapshot_taken(record: dict) -> bool:
    """Whether a step record says a snapshot was taken in its interval (log.interval=1: the
    snapshot after the previous step)."""
    return (record.get("snapshot") or {}).get("stall_ms") is not None


def _step_now(launch: Launch) -> int:
    return max((r["step"] for r in launch.records() if "loss" in r), default=0)


@pytest.fixture
def launch(tmp_path, small_data_dir):
    made: list[Launch] = []

    def start(steps: int, *flags: str) -> Launch:
        made.append(Launch(tmp_path, small_data_dir, steps, *flags))
        return made[-1]

    yield start
    for one in made:
        one.close()


@pytest.mark.slow  # a real 2-worker launch with its agent, killed and restarted
def test_a_killed_agent_is_restarted_and_snapshots_resume(launch):
    run = launch(400, "--max-restarts", "1")
    run.wait_until(lambda: sum(_snapshot_taken(r) for r in run.records()) >= 5, "five snapshots")
    [agent] = run.agents()

    os.kill(agent, signal.SIGKILL)
    killed_at, killed_wall, killed_step = time.monotonic(), time.time(), _step_now(run)
    restarted_at = run.wait_until(
        lambda: run.agents() and run.agents() != [agent], "restarted agent"
    )
    assert "strata launch: the snapshot agent exited (signal SIGKILL); restarted it" in run.log()

    def snapshot_after_kill() -> dict | None:
        later = [r for r in run.records() if r.get("step", 0) > killed_step and "loss" in r]
        return next(
            (r for r in later if _snapshot_taken(r) and r["snapshot"]["reconnects"] >= 1), None
        )

    resumed_at = run.wait_until(
        lambda: snapshot_after_kill() is not None, "snapshot after the agent restart"
    )
    first = snapshot_after_kill()
    assert first is not None
    print(
        f"agent SIGKILL at step {killed_step}; new agent seen {restarted_at - killed_at:.2f} s later; first "
        f"snapshot into it logged with step {first['step']}, {first['time'] - killed_wall:.2f} s after the "
        f"kill ({resumed_at - killed_at:.2f} s until the test saw it)"
    )
    assert (
        first["time"] - killed_wall < 10
    )  # a few steps: the agent restarts in well under a second
    assert (
        "lost the snapshot agent" in run.log() and "reconnected to the snapshot agent" in run.log()
    )

    # A worker killed now: the restarted workers resume from a snapshot the new agent holds.
    after = first["step"] + 2
    run.wait_until(lambda: _step_now(run) >= after, f"step {after}")
    [worker] = marked_processes(run.marker, RANK="1")
    os.kill(worker, signal.SIGKILL)
    assert run.proc.wait(DEADLINE_S) == 0, run.log()[-6000:]
    resumed = [r for r in run.records() if "resumed" in r]
    assert len(resumed) == 1, resumed
    note = resumed[0]["resumed"]
    assert note.startswith("snapshot: resumed from in-memory step"), note
    assert int(note.split("in-memory step ")[1].split()[0]) >= first["step"] - 1, (
        note
    )  # taken by the new agent
    assert _step_now(run) == 400


@pytest.mark.slow  # a real 2-worker launch whose agent is killed until the launcher gives up on it
def test_an_agent_that_keeps_dying_is_given_up_and_training_goes_on(launch):
    run = launch(600, "--max-restarts", "1")
    run.wait_until(lambda: any(_snapshot_taken(r) for r in run.records()), "first snapshot")
    seen: set[int] = set()
    for _ in range(AgentKeeper.MAX_RESTARTS + 1):
        run.wait_until(lambda: set(run.agents()) - seen, "a running agent")
        [agent] = run.agents()
        seen.add(agent)
        os.kill(agent, signal.SIGKILL)
    run.wait_until(lambda: "not restarting it" in run.log(), "the launcher to give up")
    gave_up_step = _step_now(run)
    run.wait_until(
        lambda: _step_now(run) >= max(gave_up_step, 20) + 2, "a disk checkpoint after giving up"
    )
    [worker] = marked_processes(run.marker, RANK="1")
    os.kill(worker, signal.SIGKILL)
    assert run.proc.wait(DEADLINE_S) == 0, run.log()[-6000:]
    assert not run.agents()
    assert run.log().count("restarted it") == AgentKeeper.MAX_RESTARTS
    assert "in-memory snapshots are off for the rest of this run" in run.log()
    late = [r for r in run.records() if "loss" in r and r["step"] > gave_up_step + 1]
    assert late and not any(
        _snapshot_taken(r) for r in late
    )  # skipped, not failed: training went on
    # Workers restarted then (a worker killed) find no agent: they go on from the disk checkpoint.
    assert (
        "this attempt runs without in-memory snapshots, from the newest disk checkpoint"
        in run.log()
    )
    found = re.findall(r"resumed from \S*/checkpoints/step_(\d+)", run.log())
    assert len(found) == 1 and int(found[0]) >= 20, found  # checkpoint.interval 20
    assert late[-1]["step"] == 600 and any(
        (r.get("snapshot") or {}).get("skipped", 0) > 0 for r in late
    )


def test_the_keeper_restarts_a_dead_agent_on_its_socket_until_the_limit(
    tmp_path, capsys, monkeypatch
):
    """AgentKeeper alone, on real agent processes: each death within the window is restarted on the
    same socket path; one more is given up on."""
    monkeypatch.setenv("STRATA_SNAPSHOT_SECRET", "ab" * 32)
    plan = LaunchPlan(1, snapshots=True)
    env = launch_env(plan)
    proc, path = start_agent(plan, env)
    keeper = AgentKeeper(plan, env, proc, path)
    try:
        for i in range(AgentKeeper.MAX_RESTARTS + 1):
            first = keeper.proc
            _wait_for_socket(path)
            first.kill()
            first.wait()
            keeper.check()
            if i < AgentKeeper.MAX_RESTARTS:
                assert keeper.proc is not first and keeper.proc.poll() is None
                assert (
                    "the snapshot agent exited (signal SIGKILL); restarted it"
                    in capsys.readouterr().err
                )
                _wait_for_socket(path)
                sock = connect(path, 5)  # the new agent answers on the same path
                assert request(sock, {"op": "hello", "rank": 0})[0]["ok"]
                sock.close()
            else:
                assert keeper.given_up and keeper.proc is first
                assert "not restarting it" in capsys.readouterr().err
        keeper.check()  # given up: nothing more is started or said
        assert keeper.proc is first and not capsys.readouterr().err
    finally:
        keeper.stop()
    assert not os.path.exists(path)


def _wait_for_socket(path: str) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.02)
