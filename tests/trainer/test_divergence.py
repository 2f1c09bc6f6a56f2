"""A diverging run is not committed: the loss-spike guard drops spiking updates and stops the run after
`train.max_spike_steps` in a row, a save of finite but implausibly large weights is refused and stops
the run, retention keeps the newest checkpoint saved before the guard fired (keep-last-good), and
`strata ckpt verify` warns about weights that are finite but implausible."""

from __future__ import annotations

import json
import math

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.manager import CheckpointManager, write_whole
from strata.checkpoint.pieces import FixedState, StateContents, whole_piece
from strata.parallel.runtime import start
from strata.trainer.divergence import DivergedError, SpikeGuard
from strata.trainer.jobs import train as run

from conftest import run_cli, tiny_config, tiny_overrides
from worlds import train_world


def noisy(n: int, level: float = 3.0, seed: int = 0) -> list[float]:
    """`n` losses around `level`, with the noise of a small batch (about 2%)."""
    g = torch.Generator().manual_seed(seed)
    return [level * (1 + 0.02 * float(x)) for x in torch.randn(n, generator=g)]


def test_a_real_spike_is_skipped_and_the_next_step_judged_normally():
    guard = SpikeGuard(sigma=6.0, window=128, min_steps=20)
    for step, loss in enumerate(noisy(40), 1):
        assert guard.judge(step, loss, 1.0) is None
    reason = guard.judge(41, 9.0, 1.0)  # the loss x3 for one step
    assert reason and reason.startswith("loss 9 is above") and "median" in reason
    assert guard.in_a_row == 1 and 9.0 in guard.losses  # every judged step joins the window
    assert guard.judge(42, 3.05, 1.0) is None and guard.in_a_row == 0
    assert guard.unstable_since(42) and not guard.unstable_since(41 + 128)
    # one outlier does not blind the guard: the next spike, even a smaller one, is caught
    assert guard.judge(43, 1000.0, 1.0) is not None
    assert guard.judge(44, 6.0, 1.0) is not None


def test_a_lasting_level_shift_is_absorbed_within_half_the_window():
    guard = SpikeGuard(sigma=6.0, window=64, min_steps=20)
    for step, loss in enumerate(noisy(64), 1):
        guard.judge(step, loss, 1.0)
    spikes = [
        step
        for step, loss in enumerate(noisy(64, level=4.5, seed=1), 65)
        if guard.judge(step, loss, 1.0) is not None
    ]
    assert spikes and spikes[0] == 65 and max(spikes) <= 64 + 32  # then the new level is normal
    assert guard.in_a_row == 0


def test_a_falling_loss_and_the_rising_gradient_norm_of_fine_tuning_are_not_spikes():
    guard = SpikeGuard(sigma=6.0, window=128, min_steps=20)
    steps = 300
    for step in range(1, steps + 1):
        loss = 6.0 - 1.0 * step / steps + 0.05 * math.sin(step)  # 6.03 -> 5.15, as a fine-tune
        norm = 0.3 + 3.0 * step / steps  # the gradient norm rises tenfold as the model moves
        assert guard.judge(step, loss, norm) is None, step
    assert guard.judge(steps + 1, 5.0, 40.0).startswith("gradient norm 40 is above 10 x")


def test_the_guard_watches_after_the_warmup_and_judges_after_its_minimum_history():
    guard = SpikeGuard(sigma=6.0, window=128, min_steps=20, watch_after=30)
    assert all(guard.judge(step, 100.0 / step, 1.0) is None for step in range(1, 31))
    assert not guard.losses  # the warm-up's steep fall is no history
    for step, loss in enumerate(noisy(19), 31):
        guard.judge(step, loss, 1.0)
    assert guard.judge(50, 30.0, 1.0) is None  # 19 steps known: not judged yet
    assert guard.judge(51, 30.0, 1.0) is not None


def test_the_guard_state_round_trips_and_a_resumed_guard_judges_alike():
    a = SpikeGuard(sigma=6.0, window=16, min_steps=4)
    values = noisy(40)
    for step, loss in enumerate(values[:30], 1):
        a.judge(step, loss if step != 25 else 20.0, 1.0)
    b = SpikeGuard(sigma=6.0, window=16, min_steps=4)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.last_spike_step == 25
    for step, loss in enumerate(values[30:], 31):
        assert a.judge(step, loss, 1.0) == b.judge(step, loss, 1.0)


def test_a_window_smaller_than_the_minimum_history_is_refused(small_data_dir, tmp_path):
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.spike_window: 10 is smaller than"):
        tiny_config(small_data_dir, tmp_path, **{"train.spike_window": 10})
    tiny_config(small_data_dir, tmp_path, **{"train.spike_window": 10, "train.spike_sigma": 0})


def skipped_steps(run_dir) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if "skipped" in r]


@pytest.mark.slow  # two short runs: ~10 s on 2 cores
def test_a_resumed_run_judges_spikes_as_the_uninterrupted_run_did(small_data_dir, tmp_path):
    # a guard so touchy that it skips some steps: its decisions depend on its whole history
    extra = {
        "train.steps": 30,
        "checkpoint.interval": 5,
        "checkpoint.keep_last": 0,
        "train.spike_sigma": 1.0,
        "train.spike_window": 8,
        "train.spike_min_steps": 4,
        "train.max_spike_steps": 30,
    }
    full_cfg = tiny_config(small_data_dir, tmp_path / "full", **extra)
    full = run(full_cfg, start())
    root = full_cfg.checkpoint_dir()
    middle = [p for p in store.committed(root) if 10 <= store.marker(p)["step"] <= 20][0]
    at = store.marker(middle)["step"]
    assert [s for s in skipped_steps(full_cfg.run_dir()) if s > at], "the guard skips after it"
    resumed_cfg = tiny_config(small_data_dir, tmp_path / "resumed", **extra)
    resumed = run(resumed_cfg, start(), resume=middle)
    assert sorted(resumed.losses) == list(range(at + 1, 31))
    for step in resumed.losses:
        assert resumed.losses[step] == full.losses[step]  # exact, not approx
    after = [s for s in skipped_steps(full_cfg.run_dir()) if s > at]
    assert skipped_steps(resumed_cfg.run_dir()) == after


def logged(run_dir) -> dict[int, dict]:
    """metrics.jsonl's training records by step."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r and "eval_loss" not in r}


@pytest.mark.slow  # four 2-process runs of 24 steps: ~50 s on 2 cores
@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {"parallel.pp": 2, "model.n_layers": 4}])
def test_a_resume_in_a_multi_process_layout_judges_spikes_and_loses_nothing(
    small_data_dir, tmp_path, layout
):
    extra = {
        **layout,
        "train.steps": 24,
        "checkpoint.interval": 12,
        "log.interval": 1,
        "train.spike_sigma": 1.0,
        "train.spike_window": 8,
        "train.spike_min_steps": 4,
        "train.max_spike_steps": 24,
    }
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    full_args = tiny_overrides(small_data_dir, tmp_path / "full", **extra)
    train_world([str(experiment), *full_args], 2, tmp_path / "full")
    full = logged(tmp_path / "full" / "t")
    assert [s for s in full if s > 12 and "skipped" in full[s]], "the guard skips after the resume"
    middle = store.step_dir(tmp_path / "full" / "t" / "checkpoints", 12)
    resumed_args = tiny_overrides(small_data_dir, tmp_path / "resumed", **extra)
    train_world([str(experiment), *resumed_args, "--resume", str(middle)], 2, tmp_path / "resumed")
    resumed = logged(tmp_path / "resumed" / "t")
    assert sorted(resumed) == list(range(13, 25))
    assert [resumed[s]["loss"] for s in resumed] == [full[s]["loss"] for s in resumed]  # exact
    assert [s for s in resumed if "skipped" in resumed[s]] == [
        s for s in full if s > 12 and "skipped" in full[s]
    ]


def test_a_checkpoint_without_the_guard_state_resumes_with_a_fresh_guard(
    small_data_dir, tmp_path, capsys
):
    extra = {"train.steps": 4, "checkpoint.interval": 2, "train.spike_sigma": 0}
    cfg = tiny_config(small_data_dir, tmp_path / "old", **extra)
    run(cfg, start())
    resumed = tiny_config(small_data_dir, tmp_path / "new", **{**extra, "train.spike_sigma": 6})
    run(resumed, start(), resume=store.step_dir(cfg.checkpoint_dir(), 2))
    assert "holds no spike_guard state (an older checkpoint): it starts afresh" in (
        capsys.readouterr().out
    )


@pytest.mark.slow  # ~10 s on 2 cores
def test_a_resume_at_a_diverging_learning_rate_stops_and_keeps_the_good_checkpoints(
    small_data_dir, tmp_path, capsys
):
    base = {"checkpoint.interval": 10, "checkpoint.keep_last": 2, "optim.grad_clip": 1.0}
    cfg = tiny_config(small_data_dir, tmp_path, **{**base, "train.steps": 40})
    run(cfg, start())
    root = cfg.checkpoint_dir()
    good = store.committed(root)
    assert [store.marker(p)["step"] for p in good] == [30, 40]
    bad = tiny_config(
        small_data_dir,
        tmp_path,
        **{**base, "train.steps": 100, "optim.lr": 3.0, "checkpoint.max_abs_weight": 0},
    )
    with pytest.raises(DivergedError, match=r"steps in a row were loss spikes") as stopped:
        run(bad, start(), resume=root)
    assert store.committed(root) == good  # nothing saved of the diverged run, nothing pruned
    named = str(stopped.value).split("--resume ")[1].split()[0].rstrip(",")
    assert named == str(good[-1])
    assert "checkpoint step" in capsys.readouterr().out  # a save after a spike was refused


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_of_implausible_weights_is_refused_and_stops_the_run(
    small_data_dir, tmp_path, background
):
    # a background save's writer checks the image: the run stops at the step after the save
    extra = {"checkpoint.interval": 2, "checkpoint.max_abs_weight": 1e-3}
    cfg = tiny_config(small_data_dir, tmp_path, **extra, **{"checkpoint.async": background})
    with pytest.raises(DivergedError, match=r"step 2: .* above checkpoint.max_abs_weight=0.001"):
        run(cfg, start())
    assert store.committed(cfg.checkpoint_dir()) == []
    assert not store.partial_dir(cfg.checkpoint_dir(), 2).exists()


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
