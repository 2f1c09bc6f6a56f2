"""Non-finite training: a step whose loss or gradient norm is NaN/inf is skipped (or stops the run),
and no checkpoint of non-finite state is ever committed, so retention never drops the last good one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.parallel.runtime import start
from strata.runlock import LOCK_NAME
from strata.trainer import parallelize as parallelize_mod
from strata.trainer.divergence import NonFiniteError
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer
from strata.trainer.lr_schedule import lr_at

from conftest import tiny_config

MICRO_BATCHES = 4  # tiny_config: global batch 8 of micro-batches of 2, one rank


def poison_steps(monkeypatch, steps: set[int] | None = None, from_step: int | None = None) -> None:
    """Make the training loss NaN at the given (1-based) steps, or at every step from `from_step`:
    the NaN flows through backward into every gradient, as a real blow-up's does. Evaluation
    (no gradients) is left alone."""
    real, calls = parallelize_mod.lm_loss, [0]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return real(logits, targets)
        calls[0] += 1
        step = (calls[0] - 1) // MICRO_BATCHES + 1
        bad = (steps is not None and step in steps) or (from_step is not None and step >= from_step)
        return real(logits * math.nan if bad else logits, targets)

    monkeypatch.setattr(parallelize_mod, "lm_loss", loss)


def state_tensors(root, step: int) -> dict[str, torch.Tensor]:
    """Parameters and optimizer states of a checkpoint (not the RNG)."""
    return {
        k: v
        for k, v in Checkpoint(store.step_dir(root, step)).tensors("").items()
        if "rng" not in k
    }


def test_a_nan_step_is_skipped_and_training_goes_on(small_data_dir, tmp_path, monkeypatch, capsys):
    poison_steps(monkeypatch, {3})
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"checkpoint.interval": 1, "checkpoint.keep_last": 0, "log.interval": 1},
    )
    result = run(cfg, start())
    assert result.final_step == 6 and math.isnan(result.losses[3])
    assert all(math.isfinite(result.losses[s]) for s in (1, 2, 4, 5, 6))
    assert result.losses[6] < result.losses[1]
    root = cfg.checkpoint_dir()
    # The skipped step updated nothing: the state after it is the state before it, bit for bit.
    before, after = state_tensors(root, 2), state_tensors(root, 3)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not all(
        torch.equal(after[k], state_tensors(root, 4)[k]) for k in after
    )  # the next one did
    assert "warning: step 3: loss nan" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in lines if "loss" in r}
    assert "update skipped" in by_step[3]["skipped"] and "skipped" not in by_step[4]
    assert by_step[6]["skipped_steps"] == 1
    # A skipped step still counts for the schedule: step 4 runs at the schedule's 4th rate.
    assert by_step[4]["lr"] == pytest.approx(lr_at(3, cfg.optim, cfg.train.steps))


def test_stop_policy_ends_the_run_at_the_first_nan_step(small_data_dir, tmp_path, monkeypatch):
    poison_steps(monkeypatch, {2})
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"train.nonfinite": "stop", "checkpoint.interval": 1, "checkpoint.keep_last": 1},
    )
    with pytest.raises(NonFiniteError) as info:
        run(cfg, start())
    assert str(info.value).startswith(
        "step 2: loss nan, gradient norm nan: not finite (train.nonfinite=stop)"
    )
    assert [p.name for p in store.committed(cfg.checkpoint_dir())] == ["step_00000001"]


def test_too_many_nan_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(
    small_data_dir, tmp_path, monkeypatch
):
    poison_steps(monkeypatch, from_step=3)
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"train.max_nonfinite_steps": 2, "checkpoint.interval": 2, "checkpoint.keep_last": 1},
    )
    with pytest.raises(NonFiniteError) as info:
        run(cfg, start())
    assert str(info.value).startswith(
        "step 4: loss nan, gradient norm nan: not finite (2 steps in a row"
    )
    assert f"--resume {cfg.checkpoint_dir()}" in str(info.value)
    assert [p.name for p in store.committed(cfg.checkpoint_dir())] == ["step_00000002"]


def test_a_save_of_non_finite_state_is_refused_and_retention_keeps_the_good_one(
    small_data_dir, tmp_path
):
    """Parameters that became NaN while the loss was still finite (an overflowing update): the save
    commits nothing, so keep_last=1 never removes the finite checkpoint before it."""
    cfg = tiny_config(small_data_dir, tmp_path, **{"checkpoint.keep_last": 1})
    trainer = Trainer(cfg, start())
    trainer.train_step()
    assert trainer.save()
    trainer.checkpoints.close()
    trainer.train_step()
    with torch.no_grad():
        trainer.model.params[0].view(-1)[0] = math.inf
    assert not trainer.save()
    trainer.checkpoints.close()
    assert [p.name for p in store.committed(cfg.checkpoint_dir())] == ["step_00000001"]
    leftovers = [
        p.name
        for p in cfg.checkpoint_dir().iterdir()
        if p.name.startswith(".") and p.name != LOCK_NAME
    ]
    assert not leftovers  # no partial save either (the run's lock file stays, by design)


def test_a_background_save_of_non_finite_state_is_discarded_and_warned_of(small_data_dir, tmp_path):
    """With checkpoint.async the writer checks the staged image, after save() returned: the run
    warns at the next step, and the finite checkpoint before stays."""
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"checkpoint.keep_last": 1, "checkpoint.async": True, "train.steps": 4},
    )
    trainer = Trainer(cfg, start())
    trainer.train_step()
    assert trainer.save()
    trainer.train_step()
    with torch.no_grad():
        trainer.model.params[0].view(-1)[0] = math.nan
    assert trainer.save()  # staged: the writer judges it
    trainer.checkpoints.close()
    step, verdict = trainer.checkpoints.take_refused()
    assert step == 2 and not verdict.finite
    assert [p.name for p in store.committed(cfg.checkpoint_dir())] == ["step_00000001"]
    assert not store.partial_dir(cfg.checkpoint_dir(), 2).exists()


def _dp_worker(rank: int, size: int, port: int, out_dir: str, cfg) -> None:
    """One rank of a dp=2 run in which only rank 1's loss turns NaN, at step 3."""
    import os

    from strata.parallel.runtime import stop

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size)
    )
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    real, calls = parallelize_mod.lm_loss, [0]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            calls[0] += 1
            if rank == 1 and (calls[0] - 1) // 2 + 1 == 3:  # 2 micro-batches per step on each rank
                logits = logits * math.nan
        return real(logits, targets)

    parallelize_mod.lm_loss = loss
    result = run(cfg, start(backend="gloo"))
    stop()
    torch.save({"losses": result.losses}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow  # a 2-process gloo world
def test_one_ranks_nan_makes_every_rank_skip_the_same_step(small_data_dir, tmp_path):
    from worlds import run_world

    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        world_size=2,
        **{"checkpoint.interval": 1, "checkpoint.keep_last": 0},
    )
    ranks = run_world(_dp_worker, 2, tmp_path, cfg)
    for r in ranks:
        assert sorted(r["losses"]) == [1, 2, 3, 4, 5, 6] and math.isnan(r["losses"][3])
        assert all(math.isfinite(r["losses"][s]) for s in (1, 2, 4, 5, 6))
    root = cfg.checkpoint_dir()
    before, after = state_tensors(root, 2), state_tensors(root, 3)
    assert all(torch.equal(before[k], after[k]) for k in before)  # neither rank updated at step 3
