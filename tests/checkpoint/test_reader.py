"""Checkpoint integrity and bad input: every file's size is checked against the commit marker before
anything is read, and every block read against its CRC-32C; a missing, truncated or corrupted file,
or a checkpoint of another model (missing / unexpected keys, other shapes), is one clear error
naming the files and keys — raised before any training state is modified. `strata ckpt
inspect|verify` report it. The format is DCP's: torch.distributed.checkpoint alone reads it."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from strata.checkpoint import integrity, store
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError
from strata.launch.cli import main as strata_main
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import tiny_config


@pytest.fixture
def saved(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir, tmp_path / "a", **{"train.steps": 2, "checkpoint.save_final": True}
    )
    run(cfg, start())
    return store.committed(cfg.checkpoint_dir())[-1]


def fresh_trainer(small_data_dir, tmp_path, **model) -> Trainer:
    return Trainer(tiny_config(small_data_dir, tmp_path / "b", **model), start())


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.parts[0].named_parameters()}


def assert_untouched(trainer: Trainer, before: dict[str, torch.Tensor]) -> None:
    assert trainer.step == 0 and not trainer.model.optimizer.state
    for name, p in trainer.model.parts[0].named_parameters():
        assert torch.equal(p, before[name]), name


def test_intact_checkpoint_verifies_and_inspects(saved, capsys):
    assert strata_main(["ckpt", "verify", str(saved)]) == 0
    assert "ok (5 files match" in capsys.readouterr().out
    assert strata_main(["ckpt", "inspect", str(saved.parent)]) == 0  # a checkpoints dir: the latest
    report = capsys.readouterr().out
    assert "step 2, saved from layout: world 1: tp 1, pp 1" in report
    assert "tok_embeddings.weight" in report and "(32,)" in report  # names with global shapes


@pytest.mark.parametrize(
    "name, damage, words",
    [
        ("__0_0.distcp", "truncate", "truncated"),
        ("__0_0.distcp", "flip", "corrupted"),
        ("__0_0.distcp", "delete", "missing"),
        ("index.json", "flip", "corrupted"),
        ("__0_1.distcp", "flip", "corrupted"),
    ],
)
def test_damaged_file_is_named_and_nothing_is_loaded(
    saved, small_data_dir, tmp_path, capsys, name, damage, words
):
    target = saved / name
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    assert strata_main(["ckpt", "verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and f"{target}: " in out and words in out
    trainer = fresh_trainer(small_data_dir, tmp_path)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError, match=words) as err:
        trainer.resume(saved)
    assert str(target) in str(err.value)
    assert_untouched(trainer, before)


@pytest.mark.parametrize(
    "model, words",
    [
        ({"model.d_model": 64}, "shape mismatches: tok_embeddings.weight"),
        ({"model.n_layers": 3}, "missing keys: layers.2."),
        ({"model.n_layers": 1}, "unexpected keys: layers.1."),
    ],
)
def test_checkpoint_of_another_model_is_one_clear_error_before_any_change(
    saved, small_data_dir, tmp_path, model, words
):
    trainer = fresh_trainer(small_data_dir, tmp_path, **model)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError, match=words) as err:
        trainer.resume(saved)
    assert str(saved) in str(err.value)
    assert_untouched(trainer, before)


def test_export_gives_weights_a_plain_model_loads(saved, small_data_dir, tmp_path, capsys):
    """Tied embeddings too: both names are written, as a plain GPT's state_dict has them."""
    from safetensors.torch import load_file

    from strata.config import load
    from strata.model import GPT

    assert strata_main(["ckpt", "export", str(saved), str(tmp_path / "hf")]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = load(tmp_path / "hf" / "config.yaml")
    model = GPT(cfg.model, weights["tok_embeddings.weight"].shape[0])
    model.load_state_dict(weights)  # strict: every key, every shape
    for name, t in Checkpoint(saved).tensors("model.").items():
        assert torch.equal(model.state_dict()[name], t), name


def test_damaged_dcp_metadata_fails_verify(saved, capsys):
    """.metadata is a pickle DCP loads blindly: verify unpickles it with DCP's classes only."""
    marker = store.marker(saved)
    evil = pickle.dumps(os.system)
    (saved / ".metadata").write_bytes(evil)
    marker["files"][".metadata"] = integrity.entry(
        evil
    )  # a checksum that matches: only the unpickler stands
    (saved / store.MARKER).write_text(json.dumps(marker))
    assert strata_main(["ckpt", "verify", str(saved)]) == 1
    assert "posix.system is not allowed" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer_key", ["optim", "optimizer"])  # Strata's, torchtitan's
def test_dcp_alone_loads_weights_and_optimizer_into_plain_torch(saved, optimizer_key):
    """torch.distributed.checkpoint's own state_dict helpers and load, a plain GPT and a torch AdamW:
    the weights and every Adam moment equal what Strata saved; the hyper-parameters come along."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    from strata.config import load
    from strata.model import GPT
    from strata.trainer.lr_schedule import lr_at
    from strata.trainer.parallelize import build_optimizer

    cfg = load(saved / "config.yaml")
    want = Checkpoint(saved).tensors("")
    model = GPT(cfg.model, want["model.tok_embeddings.weight"].shape[0])
    opt = build_optimizer(
        list(model.parameters()), dataclasses.replace(cfg.optim, lr=123.0), torch.device("cpu")
    )
    state = {
        "model": get_model_state_dict(model),
        optimizer_key: get_optimizer_state_dict(model, opt),
    }
    dcp.load(state, checkpoint_id=str(saved))
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state[optimizer_key]
    )
    named = dict(model.named_parameters())
    for key, t in want.items():
        if key.startswith("model."):
            assert torch.equal(named[key[6:]], t), key
        elif key.startswith("optim.state."):
            fqn, kind = key[len("optim.state.") :].rsplit(".", 1)
            assert torch.equal(opt.state[named[fqn]][kind], t), key
    last_lr = lr_at(
        1, cfg.optim, cfg.train.steps
    )  # the schedule's lr at the saved run's last step (step 2)
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0][
        "lr"
    ] == pytest.approx(last_lr)
