"""Background saves (`checkpoint.async`): the save call returns once the state is staged, a writer
process persists it; the next save waits only if the previous one is still being written; a writer
that fails or is killed is reported at the next step, and the previous checkpoint stays intact and
loadable. Here at the manager level with one rank and a real writer process; the multi-rank run,
killed mid-save, is at the bottom (a `strata launch` world, as in trainer/test_parallelize.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from strata.checkpoint import store, writer
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.pieces import FixedState, Piece, StateContents
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError
from strata.parallel.flat import Box

from conftest import tiny_overrides

STATE = {"model.w": (64, 48), "model.b": (48,), "optim.state.w.exp_avg": (64, 48)}


def pieces(step: int) -> list[Piece]:
    """Whole tensors whose values depend on the step (so a stale file would show)."""
    out = []
    for i, (key, shape) in enumerate(STATE.items()):
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * (step + i)
        out.append(Piece(key, shape, Box((0,) * len(shape), shape), t))
    return out


def save(mgr: CheckpointManager, step: int) -> None:
    mgr.config_yaml = "model: {}\n"
    mgr.save(
        step, FixedState(StateContents(pieces(step), {"trainer": {"step": step}}, {}, {"world": 1}))
    )


def assert_loads(path: Path, step: int) -> None:
    ckpt = Checkpoint(path)
    assert ckpt.step == step and ckpt.object("trainer") == {"step": step}
    got = ckpt.tensors("")
    for p in pieces(step):
        assert torch.equal(got[p.key], p.tensor), p.key


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def slow_writer(monkeypatch):
    """Writers sleep before and between their writes (inherited by the writer process)."""
    monkeypatch.setenv(writer.DELAY_ENV, "1.0")


@pytest.mark.slow  # the writer waits 1 s before and between writes: ~6 s
def test_async_save_returns_before_the_write_and_the_next_waits_for_it(tmp_path, slow_writer):
    mgr = CheckpointManager(tmp_path, 0, 1, async_save=True)
    try:
        save(mgr, 1)
        assert not (store.step_dir(tmp_path, 1) / store.MARKER).exists()  # the call did not wait
        save(mgr, 2)  # waits for save 1 (still writing): it is committed before save 2 starts
        assert (store.step_dir(tmp_path, 1) / store.MARKER).exists()
        mgr.close()
        assert [p.name for p in store.committed(tmp_path)] == ["step_00000001", "step_00000002"]
        assert_loads(store.step_dir(tmp_path, 1), 1)
        assert_loads(tmp_path, 2)
    finally:
        mgr.close()


@pytest.mark.slow  # the writer waits 1 s before and between writes: ~8 s
def test_killed_writer_is_reported_at_the_next_step_and_the_previous_checkpoint_loads(
    tmp_path, slow_writer
):
    mgr = CheckpointManager(tmp_path, 0, 1, async_save=True)
    save(mgr, 1)
    mgr.wait()
    save(mgr, 2)
    os.kill(mgr.writer_pid, signal.SIGKILL)  # mid-save: the writer is in its delay, then its writes
    wait_for(lambda: mgr._proc.poll() is not None)
    with pytest.raises(
        CheckpointError, match=r"step 2 was not saved.*\n.*writer .* died \(exit code -9\)"
    ):
        mgr.poll()
    assert not store.step_dir(tmp_path, 2).exists()
    assert store.resolve(tmp_path) == store.step_dir(tmp_path, 1)
    assert store.verify(tmp_path)[1] == []
    assert_loads(tmp_path, 1)
    save(mgr, 3)  # a new writer is started for the next save
    mgr.close()
    assert_loads(tmp_path, 3)


def test_writer_error_names_the_problem_at_the_next_step(tmp_path):
    mgr = CheckpointManager(tmp_path, 0, 1, async_save=True)
    store.partial_dir(tmp_path, 5).write_text("not a directory")
    save(mgr, 5)
    with pytest.raises(CheckpointError, match=r"step 5 was not saved(.|\n)*step_00000005.partial"):
        mgr.wait()
    mgr.close()


def test_keep_last_deletes_only_older_committed_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, 0, 1, keep_last=2, async_save=True)
    crashed = store.partial_dir(tmp_path, 0)
    crashed.mkdir(
        parents=True
    )  # an interrupted save: retention leaves it (the next start removes it)
    for step in (1, 2, 3, 4):
        save(mgr, step)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        crashed.name,
        "step_00000003",
        "step_00000004",
    ]


def test_a_run_resumed_from_an_earlier_step_replaces_and_outlives_the_old_timeline(tmp_path):
    """Checkpoints 3 and 6 exist; a run resumed from 3 saves 5 (keep_last 1): 5 is the latest and
    the one kept. Saving 6 again replaces the old 6 with the new state."""
    mgr = CheckpointManager(tmp_path, 0, 1)
    save(mgr, 3)
    save(mgr, 6)
    resumed = CheckpointManager(tmp_path, 0, 1, keep_last=1)
    save(resumed, 5)
    assert [p.name for p in store.committed(tmp_path)] == ["step_00000005"]
    assert store.resolve(tmp_path) == store.step_dir(tmp_path, 5)
    resumed.save(6, FixedState(StateContents(pieces(60), {"trainer": {"step": 6}}, {}, {})))
    got = Checkpoint(tmp_path).tensors("")
    assert all(torch.equal(got[p.key], p.tensor) for p in pieces(60))
    assert [p.name for p in store.committed(tmp_path)] == ["step_00000006"]


def holder_of(path: Path) -> int | None:
    """The pid of a process that has `path` open (the writer writing it)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return int(pid)
        except OSError:
            continue
    return None


@pytest.mark.slow  # a 2-process `strata launch` world
def test_two_rank_run_killed_mid_save_fails_on_every_rank_and_resumes_from_the_last_commit(
    small_data_dir, tmp_path
):
    """Two ranks, ZeRO-3 (each saves its own shard), background saves every 2 steps; rank 1's writer
    is killed with SIGKILL while it writes step 4. Both ranks stop with the error; step 2 verifies,
    and one process resumed from the checkpoints directory runs steps 3–6 as an uninterrupted run."""
    from strata.launch.cli import main as strata_main
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config
    from worlds import ZERO3, losses_from, start_strata

    settings = {
        "log.interval": 1,
        "checkpoint.interval": 2,
        "checkpoint.async": True,
        "train.micro_batch_size": 2,
    }
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    proc = start_strata(
        "launch",
        str(experiment),
        *tiny_overrides(small_data_dir, tmp_path / "killed", **settings, **ZERO3),
        "--nproc",
        "2",
        env={writer.DELAY_ENV: "1.0"},
    )
    ckpts = tmp_path / "killed" / "t" / "checkpoints"
    target = store.partial_dir(ckpts, 4) / "__1_0.distcp"
    try:
        wait_for(lambda: holder_of(target) is not None or proc.poll() is not None, timeout_s=120)
        pid = holder_of(target)
        assert pid is not None, "the run ended before rank 1 wrote step 4"
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert "checkpoint step 4 was not saved" in out and "died (exit code -9)" in out, out[-3000:]
    assert store.resolve(ckpts) == store.step_dir(ckpts, 2)
    assert strata_main(["ckpt", "verify", str(ckpts)]) == 0

    common = {"log.interval": 1, "train.micro_batch_size": 2}
    reference = run(tiny_config(small_data_dir, tmp_path / "reference", **common), start()).losses
    resumed = run(
        tiny_config(small_data_dir, tmp_path / "resumed", **common), start(), resume=ckpts
    ).losses
    assert sorted(resumed) == [3, 4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert losses_from(tmp_path / "killed" / "t")[2] == pytest.approx(reference[2], rel=1e-5)
