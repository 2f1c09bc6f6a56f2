"""`strata ckpt export --format hf --overwrite` replaces what the export writes and nothing else: a
file in OUT that this export would not write (a user's notes) is refused, and stays as it was. A
model no Hugging Face family expresses is refused by its key."""

from __future__ import annotations

import pytest

from strata.checkpoint import store
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import run_cli, tiny_config


@pytest.mark.slow  # trains a tiny run, exports three times (about 6 s)
def test_overwrite_replaces_only_what_the_export_writes(small_data_dir, tmp_path, capsys):
    cfg = tiny_config(small_data_dir, tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    run(cfg, start())
    ckpt = store.committed(cfg.checkpoint_dir())[-1]
    out = tmp_path / "hf"
    code, text = run_cli(["ckpt", "export", str(ckpt), str(out), "--format", "hf"], capsys)
    assert code == 0, text
    written = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in written  # byte-level data: their tokenizer is spelled out
    code, text = run_cli(
        ["ckpt", "export", str(ckpt), str(out), "--format", "hf", "--overwrite"], capsys
    )
    assert code == 0, text  # an earlier export of the same files is replaced
    (out / "notes.md").write_text("the user put this here")
    code, text = run_cli(
        ["ckpt", "export", str(ckpt), str(out), "--format", "hf", "--overwrite"], capsys
    )
    assert code == 2 and "does not write (notes.md)" in text, text
    assert "Traceback" not in text
    assert (out / "notes.md").read_text() == "the user put this here"
    assert sorted(p.name for p in out.iterdir()) == sorted([*written, "notes.md"])


@pytest.mark.slow  # trains a tiny MoE run, exports it
def test_an_moe_with_a_dense_first_layer_is_refused_naming_the_key(
    small_data_dir, tmp_path, capsys
):
    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{
            "train.steps": 1,
            "checkpoint.save_final": True,
            "model.moe.num_experts": 4,
            "model.moe.top_k": 2,
            "model.moe.first_dense_layers": 1,
        },
    )
    run(cfg, start())
    ckpt = store.committed(cfg.checkpoint_dir())[-1]
    code, text = run_cli(
        ["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--format", "hf"], capsys
    )
    assert code == 2 and "model.moe.first_dense_layers=1" in text, text
    assert "does not hold" not in text and not (tmp_path / "hf").exists()
