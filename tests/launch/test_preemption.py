"""Preemption: SIGUSR1 (Slurm's warning before the time limit), SIGTERM or SIGINT makes every rank
finish its step, commit a checkpoint of it and exit; resuming from it reproduces the uninterrupted
run's losses exactly; a second signal aborts at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_slurm import JOB_WAIT_S, _wait_for_job, slurm_cluster  # noqa: F401 (a fixture)

from conftest import tiny_config, tiny_overrides
from worlds import REPO, kill_marked, marked_processes, start_strata, strata, wait_for

STEPS = 400  # about 6 s of the tiny model on 2 cores: the signal arrives long before the end
LAUNCH = ["launch", str(REPO / "configs/tiny.yaml"), "--nproc", "2"]  # `strata` arguments
TRAIN = ["train", str(REPO / "configs/tiny.yaml")]


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
    notes = [
        json.loads(line).get("stopped")
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    found = [note for note in notes if note]
    assert len(found) == 1, found
    return found[0]


def _committed_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(
        int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMMITTED").is_file()
    )


def _signalled_train_run(tmp_path: Path, small_data_dir: Path, signals: list[int]) -> Path:
    """A single `strata train` that gets `signals` (20 ms apart) once it has logged three steps:
    it must exit with PREEMPTED_EXIT after committing the step it was in. Returns its run dir."""
    from strata.trainer.signals import PREEMPTED_EXIT

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    overrides = tiny_overrides(
        small_data_dir, tmp_path / "runs", **{"train.steps": 100000, "log.interval": 1}
    )
    try:
        worker = start_strata(
            *TRAIN, *overrides, marker=marker, log=tmp_path / "launch.log", cwd=tmp_path
        )
        wait_for(lambda: _steps_logged(run_dir) >= 3, 120, "three steps")
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.02)
            worker.send_signal(sig)
        code = worker.wait(60)
    finally:
        kill_marked(marker)
    assert code == PREEMPTED_EXIT, (tmp_path / "launch.log").read_text()[-3000:]
    assert _committed_steps(run_dir) == [max(_losses(run_dir))]
    return run_dir


def _launch_to_end(overrides: list[str], cwd: Path, extra: list[str] = ()) -> None:
    done = strata(*LAUNCH, *overrides, *extra, cwd=cwd)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


@pytest.fixture(scope="module")
def reference_losses(small_data_dir, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run every interrupted-and-resumed one must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    _launch_to_end(
        tiny_overrides(small_data_dir, root / "runs", **{"train.steps": STEPS, "log.interval": 1}),
        root,
    )
    losses = _losses(root / "runs" / "t")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGUSR1], ids=["SIGUSR1"]
)  # SIGTERM: tests/launch/test_signals.py
def test_a_signal_saves_the_step_and_the_resumed_run_matches(
    tmp_path, small_data_dir, reference_losses, sig
):
    from strata.trainer.signals import PREEMPTED_EXIT

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    overrides = tiny_overrides(
        small_data_dir, tmp_path / "runs", **{"train.steps": STEPS, "log.interval": 1}
    )
    try:
        launcher = start_strata(
            *LAUNCH, *overrides, marker=marker, log=tmp_path / "launch.log", cwd=tmp_path
        )
        wait_for(lambda: _steps_logged(run_dir) >= 3, 120, "three steps")
        sent = time.time()
        launcher.send_signal(sig)
        code = launcher.wait(60)
        wait_for(lambda: not marked_processes(marker), 30, "every process to exit")
        gone = time.time() - sent
    finally:
        kill_marked(marker)
    output = (tmp_path / "launch.log").read_text()
    assert code == PREEMPTED_EXIT, output[-3000:]  # every worker saved and stopped: resumable

    # The step it stopped after is the last one logged, and its checkpoint is committed.
    stopped_at = max(_losses(run_dir))
    assert 3 <= stopped_at < STEPS, stopped_at
    assert _committed_steps(run_dir) == [stopped_at]
    checkpoints = run_dir / "checkpoints"
    expected = f"stopped by {sig.name} at step {stopped_at}: checkpoint {checkpoints / f'step_{stopped_at:08d}'}"
    assert _stopped_note(run_dir) == f"{expected}; resume with --resume {checkpoints}"
    assert expected in output
    committed = (checkpoints / f"step_{stopped_at:08d}" / "COMMITTED").stat().st_mtime - sent
    print(
        f"{sig.name}: checkpoint of step {stopped_at} committed {committed:.2f} s, every process gone {gone:.2f} s"
    )
    assert gone < 30, gone  # well inside torchrun's grace period: nobody was killed

    _launch_to_end(overrides, tmp_path, ["--resume", str(checkpoints)])
    assert (
        _losses(run_dir) == reference_losses
    )  # bit-exact: every step's loss, before and after the stop


@pytest.mark.slow
def test_strata_train_exits_with_the_preempted_code_after_saving(tmp_path, small_data_dir):
    """Without torchrun in between (a single `strata train`, as srun may start it), the worker's own
    exit code reaches the caller: PREEMPTED_EXIT, which the Slurm script requeues on. SIGINT, as from
    Ctrl-C, stops the run the same way."""
    run_dir = _signalled_train_run(tmp_path, small_data_dir, [signal.SIGINT])
    assert "stopped by SIGINT" in _stopped_note(run_dir)


@pytest.mark.slow
def test_a_second_signal_aborts_without_saving(tmp_path, small_data_dir):
    """The first signal asks for a save after the step; a second one, later than REPEAT_WINDOW_S and
    while that step still runs, kills the worker at once: nothing is saved. A larger model makes a
    step last seconds, so the second signal arrives inside it."""
    from strata.trainer.signals import REPEAT_WINDOW_S

    marker = uuid.uuid4().hex
    run_dir = tmp_path / "runs" / "t"
    settings = {"train.steps": 100000, "log.interval": 1, "model.d_model": 512, "model.n_layers": 4}
    settings |= {
        "model.seq_len": 256,
        "train.global_batch_size": 16,
        "train.micro_batch_size": 8,
        "train.threads": 1,
    }
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **settings)
    try:
        worker = start_strata(
            *TRAIN, *overrides, marker=marker, log=tmp_path / "launch.log", cwd=tmp_path
        )
        wait_for(lambda: _steps_logged(run_dir) >= 1, 300, "the first step")
        worker.send_signal(signal.SIGTERM)
        time.sleep(REPEAT_WINDOW_S + 0.3)
        second = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
        seconds = time.monotonic() - second
    finally:
        kill_marked(marker)
    assert code == -signal.SIGTERM, (tmp_path / "launch.log").read_text()[-3000:]
    assert (
        _committed_steps(run_dir) == [] and _steps_logged(run_dir) == 1
    )  # step 2 neither finished nor saved
    assert seconds < 2, seconds
    print(f"second SIGTERM: worker gone {seconds:.2f} s after it")


@pytest.mark.slow
def test_the_same_signal_twice_at_once_is_one_request(tmp_path, small_data_dir):
    """Under Slurm a worker gets a signal twice within milliseconds (from slurmstepd, and passed on by
    torchrun): that is one request, and the run still saves and exits with PREEMPTED_EXIT."""
    _signalled_train_run(tmp_path, small_data_dir, [signal.SIGUSR1, signal.SIGUSR1])


def _stand_in_slurm(bin_dir: Path, log: Path) -> None:
    """scontrol and srun stand-ins: srun's job step runs until a signal, which it records."""
    bin_dir.mkdir()
    tools = {
        "scontrol": f'case "$1" in show) echo node-a; echo node-b ;; *) echo "scontrol $*" >> {log} ;; esac\n',
        "srun": (
            'case "$*" in *hostname*) echo 127.0.0.1; exit 0 ;; esac\n'
            f"trap 'echo \"step got $((128 + 10))\" >> {log}; kill $nap; exit 1' USR1\n"
            f"trap 'echo \"step got $((128 + 15))\" >> {log}; kill $nap; exit 1' TERM\n"
            "sleep 600 & nap=$!\n"
            f'echo "step started" >> {log}\n'
            "wait $nap\n"
        ),
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize(
    "sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"]
)
def test_the_batch_script_passes_a_signal_on_and_requeues_after_the_warning(
    tmp_path, sig, requeued
):
    """The batch shell (`--signal=B:USR1@…`) passes the signal on to the job step and waits for it to
    end; after the time-limit warning it requeues the job, after SIGTERM (scancel) it does not."""
    from strata.launch.slurm import SlurmJob, sbatch_script
    from strata.launch.torchrun import WorkerCommand

    script = sbatch_script(
        SlurmJob(name="t", nodes=2, gpus_per_node=1), WorkerCommand("cfg.yaml"), str(tmp_path)
    )
    assert "#SBATCH --signal=B:USR1@" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --open-mode=append" in script and "TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in script
    (tmp_path / "job.sbatch").write_text(script)
    log = tmp_path / "calls.log"
    _stand_in_slurm(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42"}
    env |= {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2"}
    job = subprocess.Popen(
        ["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, stdout=subprocess.PIPE
    )
    try:
        wait_for(lambda: log.exists() and "step started" in log.read_text(), 30, "the job step")
        job.send_signal(sig)
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    calls = log.read_text().splitlines()
    assert f"step got {128 + sig}" in calls  # passed on to the step, which the script waited for
    assert ("scontrol requeue 42" in calls) == requeued, calls
    assert job.returncode == (
        0 if requeued else 1
    )  # after a requeue, the step's own status otherwise


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_a_slurm_job_warned_of_its_time_limit_requeues_and_resumes(
    tmp_path, small_data_dir, reference_losses
):
    """On a real cluster (.ci/slurm_cluster.sh): the time-limit warning, sent early with `scancel
    --signal=USR1 --batch`, reaches the batch shell as `--signal=B:USR1@…` would; the workers on
    both nodes save and stop, the script requeues the job, and the requeued job resumes from that
    checkpoint and COMPLETES with the uninterrupted run's losses."""
    run_dir = tmp_path / "runs" / "t"
    # One thread a worker: both nodes are this machine's cores (torchrun sets 1 only for several workers a node)
    extra = {"train.steps": STEPS, "log.interval": 1, "train.threads": 1}
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **extra)
    launch = strata(
        *LAUNCH[:2],
        *overrides,
        "--slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--time",
        "00:10:00",
        cwd=tmp_path,
        timeout=120,
    )
    assert launch.returncode == 0, launch.stdout + launch.stderr
    job_id = launch.stdout.split("Submitted batch job")[1].split()[0]
    try:
        wait_for(lambda: _steps_logged(run_dir) >= 3, 240, "three steps")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        state = _wait_for_job(job_id, JOB_WAIT_S)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    output = (tmp_path / f"t-{job_id}.out").read_text()
    assert state == "COMPLETED", f"job {job_id}: {state}\n{output[-3000:]}"
    assert "requeueing job" in output and "(restart 1)" in output, output[-3000:]
    stopped_at = int(_stopped_note(run_dir).split(" at step ")[1].split(":")[0])
    assert (
        stopped_at in _committed_steps(run_dir) and 3 <= stopped_at < STEPS
    )  # (and tiny.yaml's interval saves)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in output
    assert _losses(run_dir) == reference_losses


@pytest.mark.slow  # three runs of the trainer: 5-9 s on 2 cores
def test_a_requeued_job_continues_from_its_own_newest_checkpoint(
    small_data_dir, tmp_path, monkeypatch
):
    """A requeued job runs its first arguments again, `--resume` included: with SLURM_RESTART_COUNT
    above 0 it continues from checkpoint.dir's newest checkpoint (its own progress), not from the
    older one it was submitted with; a first start still takes `--resume` as given."""
    from strata.checkpoint import store
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    extra = {"train.steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0}
    cfg = tiny_config(small_data_dir, tmp_path, **extra)
    run(cfg, start())
    submitted_with = store.step_dir(cfg.checkpoint_dir(), 2)
    again = tiny_config(
        small_data_dir, tmp_path, **{**extra, "train.steps": 6, "checkpoint.interval": 0}
    )
    assert sorted(run(again, start(), resume=submitted_with).losses) == [3, 4, 5, 6]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert sorted(run(again, start(), resume=submitted_with).losses) == [5, 6]
