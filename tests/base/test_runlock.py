"""One writer per run: a second `strata train` or `--resume` of a run that is still training is one
clear error naming the holder, a SIGKILLed holder leaves no lock behind, a multi-process job holds one
lock (its launcher refuses a second job before starting workers), and the commands that write
checkpoints outside a training job (reshard, import-hf) refuse another run's checkpoint directory,
never pruning what they did not write."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.checkpoint import store
from strata.launch import torchrun
from strata.runlock import LOCK_NAME, RunLocked, RunLocks, check_free, holder

from conftest import run_cli, tiny_hf_llama, tiny_overrides
from worlds import start_strata, strata


def start_long_run(data_dir: Path, root: Path, **settings) -> subprocess.Popen:
    """A tiny run that trains long enough to be caught holding its lock; returns once it holds it."""
    experiment = root / "experiment.yaml"
    root.mkdir(parents=True, exist_ok=True)
    experiment.write_text("{}\n")
    overrides = tiny_overrides(
        data_dir, root, **{"train.steps": 100000, "checkpoint.interval": 2, **settings}
    )
    proc = start_strata("train", str(experiment), *overrides, new_session=True)
    deadline = time.monotonic() + 120
    while holder(root / "t").get("pid") != proc.pid or not store.committed(
        root / "t" / "checkpoints"
    ):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "the run never took its lock and saved"
        time.sleep(0.2)
    return proc


def test_locks_are_shared_within_a_process_and_refused_to_another(tmp_path):
    directories = [
        (tmp_path / "run", "run directory"),
        (tmp_path / "run" / "checkpoints", "checkpoint.dir"),
    ]
    first = RunLocks(directories).acquire()
    second = RunLocks(
        directories
    ).acquire()  # a test building two trainers of one run in one process
    record = holder(tmp_path / "run")
    assert record["pid"] == os.getpid() and record["host"]
    probe = (
        "import sys; from pathlib import Path; from strata.runlock import RunLocks\n"
        "try:\n    RunLocks([(Path(sys.argv[1]), 'run directory')]).acquire()\n"
        "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n"
    )
    refused = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "run")], capture_output=True, text=True
    )
    assert (
        refused.returncode == 3
        and "RunLocked" in refused.stdout
        and f"pid {os.getpid()}" in refused.stdout
    )
    with pytest.raises(RunLocked):
        check_free([(tmp_path / "run" / "checkpoints", "checkpoint.dir")])
    first.release()
    assert (
        subprocess.run([sys.executable, "-c", probe, str(tmp_path / "run")]).returncode == 3
    )  # still shared
    second.release()
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path / "run")]).returncode == 0
    check_free(directories)


@pytest.mark.slow
def test_a_second_writer_and_a_resume_of_a_running_run_are_refused(
    small_data_dir, tmp_path, monkeypatch, capsys
):
    proc = start_long_run(small_data_dir, tmp_path / "a")
    try:
        experiment = tmp_path / "a" / "experiment.yaml"
        overrides = tiny_overrides(small_data_dir, tmp_path / "a", **{"train.steps": 3})
        resume = ["--resume", str(tmp_path / "a" / "t" / "checkpoints")]
        for extra in ([], resume, ["checkpoint.overwrite=true"]):
            second = strata("train", str(experiment), *overrides, *extra)
            assert second.returncode == 2, second.stdout + second.stderr
            assert f"is in use by pid {proc.pid} on host" in second.stderr, second.stderr
            assert "Traceback" not in second.stderr
        # the launcher refuses before it starts any worker
        launched = strata("launch", str(experiment), *overrides, "--nproc", "2")
        assert launched.returncode == 2 and f"pid {proc.pid}" in launched.stderr, launched.stderr
        # but a node joining a job of several nodes (a replacement for a lost one) finds that job's own
        # lock held: it starts its workers, whose own lock would refuse a second job
        started: list[torchrun.LaunchPlan] = []
        monkeypatch.setattr(torchrun, "run_local", lambda plan, *args: started.append(plan) or 0)
        joined = [
            "launch",
            str(experiment),
            *overrides,
            *resume,
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:1",
        ]
        code, said = run_cli(joined, capsys)
        assert code == 0 and [p.nnodes for p in started] == [2], said
        assert proc.poll() is None  # the first run trains on
        records = [
            json.loads(line)
            for line in (tmp_path / "a" / "t" / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r["step"] for r in records if "loss" in r]
        assert steps == sorted(steps) and len(set(steps)) == len(
            steps
        )  # one run's records, not two mixed
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # SIGKILL left no lock: a resume starts at once
    newest = store.marker(store.committed(tmp_path / "a" / "t" / "checkpoints")[-1])["step"]
    resumed = strata(
        "train",
        str(tmp_path / "a" / "experiment.yaml"),
        *tiny_overrides(
            small_data_dir, tmp_path / "a", **{"train.steps": newest + 2, "checkpoint.interval": 2}
        ),
        "--resume",
        str(tmp_path / "a" / "t" / "checkpoints"),
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert f"done: step {newest + 2}" in resumed.stdout and "resumed from" in resumed.stdout


@pytest.mark.slow
def test_a_multi_process_job_holds_one_lock(small_data_dir, tmp_path):
    experiment = tmp_path / "experiment.yaml"
    tmp_path.mkdir(exist_ok=True)
    experiment.write_text("{}\n")
    overrides = tiny_overrides(small_data_dir, tmp_path, **{"train.steps": 4})
    job = strata("launch", str(experiment), *overrides, "--nproc", "2")
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
    record = holder(tmp_path / "t")
    assert record["pid"] and record["command"].startswith(
        "strata "
    )  # rank 0 held it; released at exit
    check_free([(tmp_path / "t", "run directory")])


@pytest.mark.slow
def test_reshard_refuses_another_runs_checkpoints_and_prunes_nothing(small_data_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    for name in ("src", "other"):
        run(
            tiny_config(
                small_data_dir, tmp_path / name, **{"train.steps": 4, "checkpoint.interval": 1}
            ),
            start(),
        )
    other = tmp_path / "other" / "t" / "checkpoints"
    before = sorted(p.name for p in store.committed(other))
    assert len(before) == 2  # keep_last 2
    src = tmp_path / "src" / "t" / "checkpoints"
    refused = strata("ckpt", "reshard", str(src), str(other), "--to", "dp=2")
    assert (
        refused.returncode == 2 and "already holds 2 committed checkpoint(s)" in refused.stderr
    ), refused.stderr
    assert sorted(p.name for p in store.committed(other)) == before
    beside = strata("ckpt", "reshard", str(src), str(other), "--to", "dp=2", "--overwrite")
    assert beside.returncode == 0, beside.stderr[-4000:]
    after = sorted(p.name for p in store.committed(other))
    assert set(before) <= set(after)  # nothing pruned; the step written is replaced (it was there)


@pytest.mark.slow
def test_import_hf_refuses_a_directory_with_checkpoints(tmp_path):
    hf_dir = tiny_hf_llama(tmp_path / "hf")
    out = tmp_path / "out"
    first = strata("ckpt", "import-hf", str(hf_dir), str(out))
    assert first.returncode == 0, first.stderr[-4000:]
    marker = (store.step_dir(out, 0) / store.MARKER).read_bytes()
    again = strata("ckpt", "import-hf", str(hf_dir), str(out))
    assert again.returncode == 2 and "already holds 1 committed checkpoint(s)" in again.stderr, (
        again.stderr
    )
    assert "step_00000000 would be replaced" in again.stderr and "Traceback" not in again.stderr
    assert (store.step_dir(out, 0) / store.MARKER).read_bytes() == marker
    assert strata("ckpt", "import-hf", str(hf_dir), str(out), "--overwrite").returncode == 0
    assert (out / LOCK_NAME).is_file()


def test_a_fresh_start_keeps_an_earlier_runs_metrics_apart(small_data_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    run(
        tiny_config(small_data_dir, tmp_path, **{"train.steps": 2, "checkpoint.save_final": True}),
        start(),
    )
    first = (tmp_path / "t" / "metrics.jsonl").read_text()
    cfg = tiny_config(small_data_dir, tmp_path, **{"train.steps": 3, "checkpoint.overwrite": True})
    run(cfg, start())
    kept = [p for p in (tmp_path / "t").glob("metrics-*.jsonl")]
    assert len(kept) == 1 and kept[0].read_text() == first
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(steps) and max(steps) == 3 and steps.count(1) <= 1


# --- a lock path that is not a lock file, or a file system that refuses one -----------------------

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def linked_lock(directory: Path, target: Path) -> Path:
    """`directory`'s lock path made a symbolic link to the user's file `target`."""
    directory.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"the user's own file\n")
    (directory / LOCK_NAME).symlink_to(target)
    return target


def test_a_lock_that_is_a_link_leaves_its_target_alone(tmp_path):
    target = linked_lock(tmp_path / "run", tmp_path / "notes.txt")
    with pytest.raises(Exception, match="it is a symbolic link") as raised:
        RunLocks([(tmp_path / "run", "run directory")]).acquire()
    assert not isinstance(raised.value, RunLocked)
    with pytest.raises(Exception, match="it is a symbolic link"):
        check_free([(tmp_path / "run", "run directory")])
    assert target.read_bytes() == b"the user's own file\n"


def test_train_and_launch_refuse_a_linked_lock_and_keep_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torchrun, "run_local", lambda *a, **k: pytest.fail("torchrun started"))
    target = linked_lock(tmp_path / "runs" / "tiny", tmp_path / "notes.txt")
    for command in ("train", "launch"):
        code, out = run_cli([command, TINY, f"log.dir={tmp_path / 'runs'}"], capsys)
        assert code == 2 and "it is a symbolic link" in out and "Traceback" not in out, out
        assert str(tmp_path / "runs" / "tiny" / LOCK_NAME) in out
        assert target.read_bytes() == b"the user's own file\n"
    target = linked_lock(tmp_path / "ck", tmp_path / "more.txt")
    code, out = run_cli(
        ["launch", TINY, f"log.dir={tmp_path / 'other'}", f"checkpoint.dir={tmp_path / 'ck'}"],
        capsys,
    )
    assert code == 2 and "it is a symbolic link" in out and "checkpoint.dir" in out, out
    assert target.read_bytes() == b"the user's own file\n"


@pytest.mark.slow
def test_import_hf_refuses_a_linked_lock_in_out_and_keeps_the_file(tmp_path, capsys):
    tiny_hf_llama(tmp_path / "hf")
    target = linked_lock(tmp_path / "out", tmp_path / "notes.txt")
    code, out = run_cli(["ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "out")], capsys)
    assert code == 2 and "it is a symbolic link" in out and "Traceback" not in out, out
    assert target.read_bytes() == b"the user's own file\n"
    assert not store.committed(tmp_path / "out")


def _root_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: chattr +i and mounting a tmpfs")


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    """Mount points to unmount after the test."""
    made: list[Path] = []
    yield made
    for where in made:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("command", ["train", "launch"])
@pytest.mark.parametrize("problem", ["immutable", "read-only", "full"])
def test_a_lock_the_file_system_refuses_is_one_message(
    tmp_path, capsys, monkeypatch, mounts, problem, command
):
    """An immutable lock file (chattr +i), a read-only run directory, a full disk: exit 2, one
    message naming the lock file, and nothing written."""
    _root_or_skip()
    monkeypatch.setattr(torchrun, "run_local", lambda *a, **k: pytest.fail("torchrun started"))
    runs = tmp_path / "runs"
    run_dir = runs / "tiny"
    if problem == "immutable":
        if shutil.which("chattr") is None:
            pytest.skip("chattr is not installed")
        run_dir.mkdir(parents=True)
        (run_dir / LOCK_NAME).write_text("{}\n")
        if subprocess.run(["chattr", "+i", str(run_dir / LOCK_NAME)]).returncode != 0:
            pytest.skip("this file system has no immutable flag")
    elif problem == "read-only":
        _mount_tmpfs(runs, "ro,size=1m")
        mounts.append(runs)
    else:
        _mount_tmpfs(runs, "size=64k")
        mounts.append(runs)
        run_dir.mkdir()
        with open(runs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    before = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None
    try:
        code, out = run_cli([command, TINY, f"log.dir={runs}"], capsys)
        assert code == 2 and "Traceback" not in out, out
        assert f"{run_dir / LOCK_NAME}: the lock file of the run directory cannot be used" in out
        after = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None
        assert after == before
    finally:
        if problem == "immutable":
            subprocess.run(["chattr", "-i", str(run_dir / LOCK_NAME)])
