"""A diverging run is not committed: the loss-spike guard drops spiking updates and stops the run after
`train.max_spike_steps` in a row, a save of finite but implausibly large weights is refused and stops
the run, retention keeps the newest checkpoint saved before the guard fired (keep-last-good), and
`strata ckpt verify` warns about weights that are finite but implausible."""

from __future__ import annotations

import math

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.manager import CheckpointManager, write_whole
from strata.checkpoint.pieces import FixedState, StateContents, whole_piece
from strata.parallel.runtime import start
from strata.trainer.divergence import DivergedError, SpikeGuard
from strata.trainer.jobs import train as run

from conftest import run_cli, tiny_config


def test_the_guard_judges_against_its_history_and_counts_spikes_in_a_row():
    guard = SpikeGuard(sigma=6.0, window=8, min_steps=4)
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.0], 1):
        assert guard.judge(step, loss, 1.0) is None  # learning its history
    assert guard.judge(5, 3.2, 1.0) is None  # within 6 deviations
    reason = guard.judge(6, 30.0, 1.0)
    assert reason and reason.startswith("loss 30 is above") and guard.in_a_row == 1
    assert guard.judge(7, 3.0, 50.0).startswith(
        "gradient norm 50"
    )  # a gradient spike alone counts too
    assert guard.in_a_row == 2 and guard.unstable_since(7) and not guard.unstable_since(7 + 8)
    assert guard.judge(8, 3.0, 1.0) is None and guard.in_a_row == 0
    assert 30.0 not in guard.losses and len(guard.losses) == 6  # spikes never join the history
    for step in range(9, 20):
        guard.judge(step, 3.0, 1.0)
    assert len(guard.losses) == 8  # the window


@pytest.mark.slow  # trains until the spike guard fires: ~7 s on 2 cores
def test_a_diverging_run_stops_before_saving_and_keeps_its_good_checkpoints(
    small_data_dir, tmp_path, capsys
):
    # warm-up to a huge learning rate: the loss settles first, then explodes
    settings = {
        "train.steps": 60,
        "optim.lr": 30.0,
        "optim.warmup_steps": 40,
        "optim.grad_clip": 0.0,
        "checkpoint.interval": 5,
        "checkpoint.keep_last": 1,
        "train.spike_min_steps": 10,
        "train.max_spike_steps": 3,
        "checkpoint.max_abs_weight": 0,  # the spike guard alone
    }
    cfg = tiny_config(small_data_dir, tmp_path, **settings)
    with pytest.raises(DivergedError, match=r"3 steps in a row were loss spikes") as stopped:
        run(cfg, start())
    out = capsys.readouterr().out
    assert "loss spike: " in out and "update skipped" in out
    step = int(str(stopped.value).split(":")[0].split()[1])
    saved = store.committed(cfg.checkpoint_dir())
    assert saved, "checkpoints before the divergence stay"
    steps = [store.marker(p)["step"] for p in saved]
    assert max(steps) < step  # nothing of the spiking steps was saved
    good = [p for p in saved if not store.marker(p).get("suspect")]
    assert good, "keep-last-good: a checkpoint saved before the guard fired is kept"


def test_a_save_of_implausible_weights_is_refused_and_stops_the_run(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"checkpoint.interval": 2, "checkpoint.max_abs_weight": 1e-3}
    )
    with pytest.raises(DivergedError, match=r"above checkpoint.max_abs_weight=0.001"):
        run(cfg, start())
    assert store.committed(cfg.checkpoint_dir()) == []


def save(mgr: CheckpointManager, step: int, suspect: bool) -> None:
    mgr.config_yaml = "model: {}\n"
    pieces = [whole_piece("model.w", torch.full((4,), float(step)))]
    mgr.save(
        step,
        FixedState(StateContents(pieces, {"trainer": {"step": step}}, {}, {"world": 1})),
        suspect=suspect,
    )


def test_retention_keeps_the_newest_checkpoint_saved_before_the_guard_fired(tmp_path):
    mgr = CheckpointManager(tmp_path, 0, 1, keep_last=2)
    for step, suspect in ((1, False), (2, False), (3, True), (4, True), (5, True)):
        save(mgr, step, suspect)
    mgr.close()
    kept = [store.marker(p)["step"] for p in store.committed(tmp_path)]
    assert kept == [
        2,
        4,
        5,
    ]  # the last two, and step 2: the newest saved before the run went unstable
    mgr = CheckpointManager(tmp_path, 0, 1, keep_last=2)
    save(mgr, 6, False)  # stable again: step 6 is the last good one, and 2 may go
    mgr.close()
    assert [store.marker(p)["step"] for p in store.committed(tmp_path)] == [5, 6]


def test_verify_warns_about_finite_but_implausible_weights(tmp_path, capsys):
    from strata.config import ModelConfig
    from strata.model import build_model

    shape = {
        "n_layers": 1,
        "d_model": 4,
        "n_heads": 1,
        "seq_len": 8,
        "vocab_size": 8,
        "tie_embeddings": False,
    }

    def checkpoint(root, scale):
        model = build_model(ModelConfig(**shape), 8, seed=0)
        tensors = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
        tensors["model.tok_embeddings.weight"] = torch.ones(8, 4) * scale
        config_yaml = (
            "model: {" + ", ".join(f"{k}: {str(v).lower()}" for k, v in shape.items()) + "}\n"
        )
        return write_whole(root, 3, tensors, {"trainer": {"step": 3}}, {}, config_yaml, {})

    sound = checkpoint(tmp_path / "sound", 0.02)
    code, out = run_cli(["ckpt", "verify", str(sound)], capsys)
    assert code == 0 and "ok" in out and "implausible" not in out
    diverged = checkpoint(tmp_path / "diverged", 1e29)
    code, out = run_cli(["ckpt", "verify", str(diverged)], capsys)
    assert code == 0, out  # sound files: a warning, not damage
    assert "finite but implausible: |tok_embeddings.weight| reaches 1e+29" in out
    assert math.isfinite(1e29)
