"""Preemption: SIGUSR1 (Slurm's warning before the time limit), SIGTERM or SIGINT makes every rank
finish its step, commit a checkpoint of it and exit; resuming from it reproduces the uninterrupted
run's losses exactly; a second signal aborts at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_launch_signals import _kill_all, _processes, _start, _wait_for

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[1]
STEPS = 400  # about 6 s of the tiny model on 2 cores: the signal arrives long before the end
LAUNCH = [sys.executable, "-m", "strata.launch.cli", "launch", str(REPO / "configs/tiny.yaml"), "--nproc", "2"]
TRAIN = [sys.executable, "-m", "strata.launch.cli", "train", str(REPO / "configs/tiny.yaml")]


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss from metrics.jsonl (a resumed run appends to the interrupted run's file)."""
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            assert record["step"] not in losses, f"step {record['step']} logged twice"
            losses[record["step"]] = record["loss"]
    return losses


def _steps_logged(run_dir: Path) -> int:
    try:
        return len(_losses(run_dir))
    except (OSError, ValueError, AssertionError):
        return 0


def _stopped_note(run_dir: Path) -> str:
    notes = [json.loads(line).get("stopped") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    found = [note for note in notes if note]
    assert len(found) == 1, found
    return found[0]


def _committed_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMMITTED").is_file())


def _launch_to_end(overrides: list[str], cwd: Path, extra: list[str] = ()) -> None:
    done = subprocess.run(LAUNCH + overrides + list(extra), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


@pytest.fixture(scope="module")
def reference_losses(small_data_dir, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run every interrupted-and-resumed one must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    _launch_to_end(tiny_overrides(small_data_dir, root / "runs", **{"train.steps": STEPS, "log.interval": 1}), root)
    losses = _losses(root / "runs" / "t")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_saves_the_step_and_the_resumed_run_matches(tmp_path, small_data_dir, reference_losses, sig):
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **{"train.steps": STEPS, "log.interval": 1})
    try:
        launcher = _start(LAUNCH + overrides, marker, tmp_path)
        _wait_for(lambda: _steps_logged(run_dir) >= 3, 120, "three steps")
        sent = time.time()
        launcher.send_signal(sig)
        code = launcher.wait(60)
        _wait_for(lambda: not _processes(marker), 30, "every process to exit")
        gone = time.time() - sent
    finally:
        _kill_all(marker)
    output = (tmp_path / "launch.log").read_text()
    assert code == 128 + sig, output[-3000:]  # the launcher reports the signal that stopped the job

    # The step it stopped after is the last one logged, and its checkpoint is committed.
    stopped_at = max(_losses(run_dir))
    assert 3 <= stopped_at < STEPS, stopped_at
    assert _committed_steps(run_dir) == [stopped_at]
    checkpoints = run_dir / "checkpoints"
    expected = f"stopped by {sig.name} at step {stopped_at}: checkpoint {checkpoints / f'step_{stopped_at:08d}'}"
    assert _stopped_note(run_dir) == f"{expected}; resume with --resume {checkpoints}"
    assert expected in output
    committed = (checkpoints / f"step_{stopped_at:08d}" / "COMMITTED").stat().st_mtime - sent
    print(f"{sig.name}: checkpoint of step {stopped_at} committed {committed:.2f} s, every process gone {gone:.2f} s")
    assert gone < 30, gone  # well inside torchrun's grace period: nobody was killed

    _launch_to_end(overrides, tmp_path, ["--resume", str(checkpoints)])
    assert _losses(run_dir) == reference_losses  # bit-exact: every step's loss, before and after the stop


@pytest.mark.slow
def test_strata_train_exits_with_the_preempted_code_after_saving(tmp_path, small_data_dir):
    """Without torchrun in between (a single `strata train`, as srun may start it), the worker's own
    exit code reaches the caller: PREEMPTED_EXIT, which the Slurm script requeues on. SIGINT, as from
    Ctrl-C, stops the run the same way."""
    from strata.trainer.loop import PREEMPTED_EXIT

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **{"train.steps": 100000, "log.interval": 1})
    try:
        worker = _start(TRAIN + overrides, marker, tmp_path)
        _wait_for(lambda: _steps_logged(run_dir) >= 3, 120, "three steps")
        worker.send_signal(signal.SIGINT)
        code = worker.wait(60)
    finally:
        _kill_all(marker)
    assert code == PREEMPTED_EXIT, (tmp_path / "launch.log").read_text()[-3000:]
    assert _committed_steps(run_dir) == [max(_losses(run_dir))]
    assert "stopped by SIGINT" in _stopped_note(run_dir)


@pytest.mark.slow
def test_a_second_signal_aborts_without_saving(tmp_path, small_data_dir):
    """The first signal asks for a save after the step; a second one, later than REPEAT_WINDOW_S and
    while that step still runs, kills the worker at once: nothing is saved. A larger model makes a
    step last seconds, so the second signal arrives inside it."""
    from strata.trainer.loop import REPEAT_WINDOW_S

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    settings = {"train.steps": 100000, "log.interval": 1, "model.d_model": 512, "model.n_layers": 4}
    settings |= {"model.seq_len": 256, "train.global_batch_size": 16, "train.micro_batch_size": 8, "train.threads": 1}
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **settings)
    try:
        worker = _start(TRAIN + overrides, marker, tmp_path)
        _wait_for(lambda: _steps_logged(run_dir) >= 1, 300, "the first step")
        worker.send_signal(signal.SIGTERM)
        time.sleep(REPEAT_WINDOW_S + 0.3)
        second = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
        seconds = time.monotonic() - second
    finally:
        _kill_all(marker)
    assert code == -signal.SIGTERM, (tmp_path / "launch.log").read_text()[-3000:]
    assert _committed_steps(run_dir) == [] and _steps_logged(run_dir) == 1  # step 2 neither finished nor saved
    assert seconds < 2, seconds
    print(f"second SIGTERM: worker gone {seconds:.2f} s after it")


@pytest.mark.slow
def test_the_same_signal_twice_at_once_is_one_request(tmp_path, small_data_dir):
    """Under Slurm a worker gets a signal twice within milliseconds (from slurmstepd, and passed on by
    torchrun): that is one request, and the run still saves and exits with PREEMPTED_EXIT."""
    from strata.trainer.loop import PREEMPTED_EXIT

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **{"train.steps": 100000, "log.interval": 1})
    try:
        worker = _start(TRAIN + overrides, marker, tmp_path)
        _wait_for(lambda: _steps_logged(run_dir) >= 3, 120, "three steps")
        worker.send_signal(signal.SIGUSR1)
        time.sleep(0.02)
        worker.send_signal(signal.SIGUSR1)
        code = worker.wait(60)
    finally:
        _kill_all(marker)
    assert code == PREEMPTED_EXIT, (tmp_path / "launch.log").read_text()[-3000:]
    assert _committed_steps(run_dir) == [max(_losses(run_dir))]
