"""The training loop in one process: learning, accumulation, schedule, checkpoint/resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.config import OptimConfig
from strata.errors import CheckpointError
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer
from strata.trainer.lr_schedule import lr_at

from conftest import tiny_config


@pytest.mark.slow  # trains long enough to learn: 5-8 s on 2 cores
def test_loss_decreases_on_demo_corpus(tmp_path):
    """The built-in corpus (stdlib sources, prepared on first use) is learnable: eval loss falls
    well below the uniform-guess loss ln(257) and below the first evaluation."""
    cfg = tiny_config(
        None,
        tmp_path,
        **{
            "data.path": None,
            "train.steps": 40,
            "train.eval_interval": 10,
            "optim.warmup_steps": 5,
        },
    )
    result = run(cfg, start())
    evals = [result.eval_losses[s] for s in sorted(result.eval_losses)]
    assert evals[-1] < evals[0] - 0.1
    assert evals[-1] < math.log(257) - 1.5
    assert result.losses[40] < result.losses[1] - 1.5
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "tokens_per_s", "lr", "grad_norm"} <= set(next(r for r in lines if "loss" in r))


def test_grad_accumulation_matches_one_big_batch(small_data_dir, tmp_path):
    """4 micro-batches of 2 = 1 micro-batch of 8 (same global batch), up to fp32 summation order."""
    accum = run(
        tiny_config(small_data_dir, tmp_path / "a", **{"train.micro_batch_size": 2}), start()
    )
    whole = run(
        tiny_config(small_data_dir, tmp_path / "b", **{"train.micro_batch_size": 8}), start()
    )
    for step in accum.losses:
        assert accum.losses[step] == pytest.approx(whole.losses[step], rel=1e-5)


def test_lr_schedule_warmup_then_cosine_to_min():
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through decay
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    lin = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert lr_at(25, lin, 100) == pytest.approx(0.75)


def test_warmup_longer_than_the_run_warms_up_over_all_steps():
    o = OptimConfig(lr=1.0, warmup_steps=50, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_at(s, o, 4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    exact = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, exact, 4) for s in range(4)] == [lr_at(s, o, 4) for s in range(4)]


def test_short_trial_of_a_long_warmup_trains_and_warns(small_data_dir, tmp_path, capsys):
    """The newcomer's first try, `strata train configs/tiny.yaml train.steps=4`, in small: it trains
    all its steps, at a rising learning rate, and says the warm-up was cut short."""
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"train.steps": 4, "optim.warmup_steps": 50, "log.interval": 1}
    )
    result = run(cfg, start())
    assert result.final_step == 4 and all(math.isfinite(v) for v in result.losses.values())
    out = capsys.readouterr().out
    assert "warning: optim.warmup_steps=50 exceeds train.steps=4: the warm-up is cut short" in out
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in lines if "lr" in r]
    assert lrs == pytest.approx([1e-2 * k / 4 for k in (1, 2, 3, 4)])


def test_resume_reproduces_losses_bit_for_bit(small_data_dir, tmp_path):
    """Run 8 steps checkpointing at 4; a fresh trainer resumed from step 4 gives steps 5..8 with
    exactly the same losses and ends with exactly the same parameters."""
    extra = {"train.steps": 8, "checkpoint.interval": 4, "checkpoint.keep_last": 0}
    full_cfg = tiny_config(small_data_dir, tmp_path / "full", **extra)
    full = run(full_cfg, start())
    ckpt_root = full_cfg.checkpoint_dir()
    assert [p.name for p in store.committed(ckpt_root)] == ["step_00000004", "step_00000008"]

    resumed_cfg = tiny_config(small_data_dir, tmp_path / "resumed", **extra)
    resumed = run(resumed_cfg, start(), resume=store.step_dir(ckpt_root, 4))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step in resumed.losses:
        assert resumed.losses[step] == full.losses[step]  # exact, not approx
    a = Checkpoint(store.step_dir(ckpt_root, 8)).tensors("")  # parameters and optimizer states
    b = Checkpoint(store.step_dir(resumed_cfg.checkpoint_dir(), 8)).tensors("")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_picks_latest_committed_and_ignores_partial(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"train.steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0},
    )
    run(cfg, start())
    root = cfg.checkpoint_dir()
    (store.step_dir(root, 4) / store.MARKER).unlink()  # as if the step-4 save had died
    assert store.resolve(root) == store.step_dir(root, 2)
    with pytest.raises(CheckpointError, match="COMMITTED"):
        store.resolve(store.step_dir(root, 4))
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        store.resolve(tmp_path / "nowhere")


def test_resume_into_other_model_is_a_clear_error(small_data_dir, tmp_path):
    cfg = tiny_config(small_data_dir, tmp_path / "a", **{"train.steps": 2})
    cfg_saved = tiny_config(
        small_data_dir, tmp_path / "a", **{"train.steps": 2, "checkpoint.save_final": True}
    )
    run(cfg_saved, start())
    other = tiny_config(small_data_dir, tmp_path / "b", **{"model.d_model": 64})
    with pytest.raises(CheckpointError, match="does not fit"):
        Trainer(other, start()).resume(cfg.checkpoint_dir())


def test_new_run_refuses_a_checkpoint_dir_holding_committed_checkpoints(small_data_dir, tmp_path):
    """A second start without --resume in the same checkpoint.dir would replace the first run's
    checkpoints: refused before any training, naming --resume and checkpoint.overwrite; with
    overwrite it trains from step 0 and replaces them."""
    extra = {"train.steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0}
    cfg = tiny_config(small_data_dir, tmp_path, **extra)
    run(cfg, start())
    root = cfg.checkpoint_dir()
    before = {p.name: (p / store.MARKER).read_bytes() for p in store.committed(root)}
    assert list(before) == ["step_00000002", "step_00000004"]
    metrics = (tmp_path / "t" / "metrics.jsonl").read_text()
    again = tiny_config(small_data_dir, tmp_path, **{**extra, "train.steps": 6})
    with pytest.raises(CheckpointError, match="holds 2 committed checkpoint") as info:
        run(again, start())
    assert f"--resume {root}" in str(info.value) and "checkpoint.overwrite=true" in str(info.value)
    assert {
        p.name: (p / store.MARKER).read_bytes() for p in store.committed(root)
    } == before  # untouched
    assert (tmp_path / "t" / "metrics.jsonl").read_text() == metrics  # no step was taken
    resumed = run(again, start(), resume=root)  # what the message says: continue it
    assert sorted(resumed.losses) == [5, 6]
    fresh = run(
        tiny_config(small_data_dir, tmp_path, **{**extra, "checkpoint.overwrite": True}), start()
    )
    assert sorted(fresh.losses) == [1, 2, 3, 4]
    assert (store.step_dir(root, 4) / store.MARKER).read_bytes() != before[
        "step_00000004"
    ]  # replaced


def test_restarted_workers_continue_from_their_newest_checkpoint(
    small_data_dir, tmp_path, monkeypatch
):
    """Workers torchrun restarts after a failure get the job's first arguments (no --resume): they
    continue from the newest committed checkpoint of checkpoint.dir instead of being refused."""
    extra = {"train.steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0}
    run(tiny_config(small_data_dir, tmp_path, **extra), start())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = run(tiny_config(small_data_dir, tmp_path, **{**extra, "train.steps": 6}), start())
    assert sorted(result.losses) == [5, 6]


def test_keep_last_prunes_old_checkpoints(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"train.steps": 6, "checkpoint.interval": 1, "checkpoint.keep_last": 2},
    )
    run(cfg, start())
    assert [p.name for p in store.committed(cfg.checkpoint_dir())] == [
        "step_00000005",
        "step_00000006",
    ]
    assert not list(cfg.checkpoint_dir().glob(".*tmp*"))


def test_bf16_autocast_trains_close_to_fp32(small_data_dir, tmp_path):
    fp32 = run(tiny_config(small_data_dir, tmp_path / "a"), start())
    bf16 = run(tiny_config(small_data_dir, tmp_path / "b", **{"train.precision": "bf16"}), start())
    assert bf16.losses[1] == pytest.approx(fp32.losses[1], rel=0.02)
    assert bf16.losses[6] < bf16.losses[1]


@pytest.mark.slow  # wandb starts its service process: ~15 s on 2 cores
def test_wandb_offline_logs_without_network(small_data_dir, tmp_path, monkeypatch):
    """log.wandb=true with WANDB_MODE=offline: the run finishes and wandb wrote an offline run
    holding our metrics under the run directory."""
    import wandb  # installed by the test extra

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(small_data_dir, tmp_path, **{"log.wandb": True, "log.interval": 2})
    result = run(cfg, start())
    assert result.final_step == 6
    runs = list((tmp_path / "t" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = list(runs[0].glob("*.wandb"))
    assert history and history[0].stat().st_size > 0
    assert wandb.run is None  # finished, not left open
