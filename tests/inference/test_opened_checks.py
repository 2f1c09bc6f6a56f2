"""What `strata generate` and `strata ckpt export --format hf` check of what they read: a Strata
checkpoint's files against its commit marker (as every resume does), and the run's tokenizer.json
against the checksum its prepared data's meta.json records."""

from __future__ import annotations

import json
import shutil

import pytest

from strata.checkpoint import store
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import prepare_readme, run_cli, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run on BPE data (final checkpoint) and its prepared data directory."""
    root = tmp_path_factory.mktemp("run")
    data = prepare_readme(root / "bpe", "bpe:300")
    cfg = tiny_config(data, root, **{"train.steps": 2, "checkpoint.save_final": True})
    run(cfg, start())
    return store.committed(cfg.checkpoint_dir())[-1], data


@pytest.mark.slow  # prepares BPE data and trains a tiny run
def test_a_truncated_checkpoint_file_is_one_error_naming_it(trained, tmp_path, capsys):
    ckpt, _ = trained
    copy = tmp_path / ckpt.name
    shutil.copytree(ckpt, copy)
    record = json.loads((copy / store.MARKER).read_text())
    name = max(
        (n for n in record["files"] if n not in ("index.json", "config.yaml")),
        key=lambda n: record["files"][n]["bytes"],
    )
    with open(copy / name, "r+b") as f:
        f.truncate(record["files"][name]["bytes"] // 2)
    code, out = run_cli(["generate", str(copy), "--prompt", "Strata"], capsys)
    assert code == 2 and "is damaged" in out and str(copy / name) in out, out
    assert "Traceback" not in out


@pytest.mark.slow  # prepares BPE data and trains a tiny run
def test_a_swapped_tokenizer_is_refused_by_generate_and_export(trained, tmp_path, capsys):
    ckpt, data = trained
    code, out = run_cli(["generate", str(ckpt), "--prompt", "Strata"], capsys)
    assert code == 0, out
    tokenizer, meta = data / "tokenizer.json", data / "meta.json"
    original = tokenizer.read_text()
    spec = json.loads(original)
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {k: len(vocab) - 1 - v for k, v in vocab.items()}
    tokenizer.write_text(json.dumps(spec))
    try:
        code, out = run_cli(["generate", str(ckpt), "--prompt", "Strata"], capsys)
        assert code == 2 and str(tokenizer) in out and str(meta) in out, out
        hf = tmp_path / "hf"
        code, out = run_cli(["ckpt", "export", str(ckpt), str(hf), "--format", "hf"], capsys)
        assert code == 2 and str(tokenizer) in out and str(meta) in out, out
        assert not hf.exists() and "Traceback" not in out
    finally:
        tokenizer.write_text(original)
