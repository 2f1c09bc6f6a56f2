"""`strata launch` owns its processes: a stop signal to the launcher reaches torchrun and every
worker (each a session leader, so no process group reaches them all), workers that outlive the
grace period are killed, a second signal kills at once, and the exit code says which signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from strata.checkpoint import store

from conftest import tiny_overrides
from worlds import REPO, kill_marked, marked_processes, start, start_strata, strata, wait_for

# A stand-in for torchrun with two stand-in workers, each a session leader (as torchrun starts
# them) with a child of its own (as the checkpoint writer is). Stubborn ones ignore every signal
# the launcher sends: the worst case the launcher has to clean up after.
STAND_IN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    role, stubborn = sys.argv[1], sys.argv[2] == "stubborn"
    if stubborn:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
    if role == "torchrun":
        for _ in range(2):
            subprocess.Popen([sys.executable, __file__, "worker", sys.argv[2]], start_new_session=True)
    elif role == "worker":
        subprocess.Popen([sys.executable, __file__, "child", sys.argv[2]])
    time.sleep(600)
    """
)
STAND_IN_PROCESSES = 6  # launcher, torchrun, two workers, their two children


def _stop_and_measure(
    launcher: subprocess.Popen, marker: str, signals: list[int], timeout: float
) -> tuple[int, float]:
    """Send `signals` (0.3 s apart) to the launcher; its exit code and the seconds from the first
    signal until no process of the test is left."""
    began = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)
        launcher.send_signal(sig)
    code = launcher.wait(timeout)
    wait_for(
        lambda: not marked_processes(marker),
        timeout - (time.monotonic() - began),
        "every process to exit",
    )
    return code, time.monotonic() - began


def _stand_in_launch(
    tmp_path: Path, marker: str, grace_s: int, margin_s: int, stubborn: bool
) -> subprocess.Popen:
    """A launcher (the real Supervisor, with short limits) over the stand-ins; returns once all of
    them run."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    kind = "stubborn" if stubborn else "polite"
    launcher = textwrap.dedent(
        f"""
        import os, sys
        from strata.launch import supervisor as launcher
        launcher.STOP_GRACE_S, launcher.KILL_MARGIN_S = {grace_s}, {margin_s}
        supervisor = launcher.Supervisor()
        with supervisor.handling():
            sys.exit(supervisor.run([sys.executable, {str(script)!r}, "torchrun", {kind!r}], dict(os.environ)))
        """
    )
    proc = start(
        [sys.executable, "-c", launcher], marker=marker, log=tmp_path / "launch.log", cwd=tmp_path
    )
    wait_for(
        lambda: len(marked_processes(marker)) == STAND_IN_PROCESSES, 30, "the stand-ins to start"
    )
    return proc


def test_workers_that_ignore_the_signal_are_killed_after_the_grace_period(tmp_path):
    marker = uuid.uuid4().hex
    try:
        launcher = _stand_in_launch(tmp_path, marker, grace_s=1, margin_s=1, stubborn=True)
        code, seconds = _stop_and_measure(launcher, marker, [signal.SIGTERM], timeout=20)
        assert code == 128 + signal.SIGTERM
        assert 2 <= seconds < 10, seconds  # not before the grace period and the margin, soon after
    finally:
        kill_marked(marker)


def test_a_second_signal_kills_at_once(tmp_path):
    marker = uuid.uuid4().hex
    try:
        launcher = _stand_in_launch(tmp_path, marker, grace_s=60, margin_s=5, stubborn=True)
        code, seconds = _stop_and_measure(
            launcher, marker, [signal.SIGINT, signal.SIGINT], timeout=20
        )
        assert code == 128 + signal.SIGINT
        assert seconds < 10, seconds  # long before the 65 s the first signal alone would take
        assert "again: killing torchrun and its workers" in (tmp_path / "launch.log").read_text()
    finally:
        kill_marked(marker)


def test_torchrun_stops_when_the_launcher_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance to pass anything on: torchrun gets SIGTERM from the
    kernel (its parent-death signal) instead."""
    marker = uuid.uuid4().hex
    try:
        launcher = _stand_in_launch(tmp_path, marker, grace_s=60, margin_s=5, stubborn=False)
        torchrun = [
            pid
            for pid in marked_processes(marker)
            if b"\0torchrun\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(torchrun) == 1
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not set(torchrun) & set(marked_processes(marker)), 10, "torchrun to exit")
    finally:
        kill_marked(marker)


def test_nnodes_without_a_rendezvous_endpoint_is_an_error(tmp_path):
    done = strata(
        "launch", str(REPO / "configs/tiny.yaml"), "--nnodes", "2", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert (
        "--nnodes 2 needs a rendezvous" in done.stderr
        and "--rdzv-endpoint HOST:PORT" in done.stderr
    )
    assert "--rdzv-store external" in done.stderr and "Traceback" not in done.stderr


def test_an_external_store_needs_its_address():
    from strata.errors import StrataError
    from strata.launch.torchrun import LaunchPlan, check_plan

    with pytest.raises(StrataError, match="--rdzv-endpoint HOST:PORT"):
        check_plan(LaunchPlan(2, external_store=True))
    check_plan(
        LaunchPlan(2, nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    )  # a reachable rendezvous is fine


def _first_step_logged(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    try:
        return any(
            "step" in json.loads(line) for line in metrics.read_text().splitlines() if line.strip()
        )
    except (OSError, ValueError):
        return False


# SIGINT's run also has a snapshot agent (local snapshots) and interval checkpoints.
BUSY = {"snapshot.every_steps": 1, "snapshot.k": 1, "snapshot.m": 0, "checkpoint.interval": 2}
# ... and a checkpoint writer process per worker, in the worker's process group: torchrun's SIGINT
# reaches it too, and it must outlive it, or the stop's save fails.
ASYNC = (signal.SIGINT, {**BUSY, "checkpoint.async": True})


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, extra",
    [
        (signal.SIGTERM, {}),
        (signal.SIGINT, BUSY),
        ASYNC,
        (signal.SIGTERM, {"checkpoint.async": True, "checkpoint.interval": 2}),
        (signal.SIGUSR1, {}),
    ],
    ids=["SIGTERM", "SIGINT-busy", "SIGINT-busy-async", "SIGTERM-async", "SIGUSR1"],
)
def test_a_signal_to_strata_launch_stops_torchrun_and_every_worker(
    tmp_path, small_data_dir, sig, extra
):
    """Every worker saves and stops: `strata launch` exits PREEMPTED_EXIT, as each worker did
    (torchrun alone would report the signal)."""
    from strata.trainer.signals import PREEMPTED_EXIT

    marker = uuid.uuid4().hex
    try:
        launcher = _launch(tmp_path, marker, small_data_dir, extra)
        assert len(marked_processes(marker)) >= 4 + (
            1 if extra else 0
        )  # launcher, torchrun, two workers (agent)
        code, seconds = _stop_and_measure(launcher, marker, [sig], timeout=60)
        log = (tmp_path / "launch.log").read_text()
        assert code == PREEMPTED_EXIT, log[-3000:]
        assert f"stopped by {signal.Signals(sig).name} at step" in log
        assert store.committed(tmp_path / "runs" / "t" / "checkpoints")
        assert seconds < 30, (
            seconds
        )  # the workers exit on the signal: no waiting for the grace period
        print(f"{signal.Signals(sig).name}: every process gone {seconds:.2f} s after the signal")
    finally:
        kill_marked(marker)


@pytest.mark.slow
def test_workers_killed_by_a_second_signal_leave_the_signals_code(tmp_path, small_data_dir):
    """A second SIGTERM kills the workers before they have saved (they are held stopped, so none
    can): the launcher exits 128 + SIGTERM, not the saved-and-stopped code."""
    marker = uuid.uuid4().hex
    try:
        launcher = _launch(tmp_path, marker, small_data_dir, {})
        workers = [pid for rank in ("0", "1") for pid in marked_processes(marker, RANK=rank)]
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        code, _ = _stop_and_measure(launcher, marker, [signal.SIGTERM, signal.SIGTERM], timeout=60)
        log = (tmp_path / "launch.log").read_text()
        assert code == 128 + signal.SIGTERM, log[-3000:]
        assert "again: killing torchrun and its workers" in log
    finally:
        kill_marked(marker)


def _launch(tmp_path: Path, marker: str, data_dir: Path, extra: dict) -> subprocess.Popen:
    """`strata launch` of 2 tiny workers training a long run, once the first step is logged (and
    the first checkpoint committed, with checkpoint.interval)."""
    settings = {"train.steps": 100000, "log.interval": 1, **extra}
    overrides = tiny_overrides(data_dir, tmp_path / "runs", **settings)
    cmd = ["launch", str(REPO / "configs/tiny.yaml"), "--nproc", "2", *overrides]
    launcher = start_strata(*cmd, marker=marker, log=tmp_path / "launch.log", cwd=tmp_path)
    wait_for(lambda: _first_step_logged(tmp_path / "runs" / "t"), 120, "the workers' first step")
    if (
        "checkpoint.interval" in extra
    ):  # the asynchronous writers start with the first save: signal after it
        wait_for(
            lambda: store.committed(tmp_path / "runs" / "t" / "checkpoints"),
            120,
            "the first checkpoint",
        )
    return launcher


def test_the_launcher_reads_the_saved_and_stopped_code_of_the_latest_attempt(tmp_path):
    """`strata launch` exits with the workers' code only when every worker of this node's latest
    attempt noted the same saved-and-stopped code."""
    from strata.launch.supervisor import STATUS_ENV, note_worker_status, workers_preempted

    def note(attempt: int, local: int, status: str) -> None:
        env = {
            STATUS_ENV: str(tmp_path),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "LOCAL_RANK": str(local),
        }
        note_worker_status(status, env)

    assert workers_preempted(str(tmp_path), 2) is None  # nothing started
    note(0, 0, "running")
    note(0, 1, "running")
    assert workers_preempted(str(tmp_path), 2) is None  # running, failed or killed
    note(0, 0, "75")
    assert workers_preempted(str(tmp_path), 2) is None  # one of two saved
    note(0, 1, "75")
    assert workers_preempted(str(tmp_path), 2) == 75
    note(
        1, 0, "running"
    )  # a restarted attempt (torchrun restarts after a failure) that did not stop so
    assert workers_preempted(str(tmp_path), 2) is None
    assert workers_preempted(str(tmp_path / "gone"), 2) is None
    note_worker_status("75", {})  # not under `strata launch`: nothing to do
