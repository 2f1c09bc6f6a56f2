"""Every reader of a checkpoint makes the same checks: `strata ckpt verify`, `inspect`, `export` and
`--resume` (the trainer's load) all refuse a damaged checkpoint — an index pointing outside the
directory or past a file's end, a truncated or corrupted data file, a damaged `.metadata` or
`config.yaml`, a recorded file missing or replaced by a link out — naming the damaged file, and a
structural problem is found on opening, identically by verify and by the load, before anything is
read. Only verify reads every data block; a load checks the blocks it reads."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.checkpoint import inspect, integrity, store
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError
from strata.launch.cli import main as strata_main
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import tiny_config, tiny_overrides


@pytest.fixture
def saved(small_data_dir, tmp_path) -> Path:
    cfg = tiny_config(
        small_data_dir, tmp_path / "a", **{"train.steps": 2, "checkpoint.save_final": True}
    )
    run(cfg, start())
    return store.committed(cfg.checkpoint_dir())[-1]


def rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file and record its new checksum, so only the structural checks can object."""
    (ckpt / name).write_bytes(data)
    record = store.marker(ckpt)
    record["files"][name] = integrity.entry(data)
    (ckpt / store.MARKER).write_text(json.dumps(record))


def weight_chunk(index: dict) -> dict:
    """The first saved chunk of a model weight (the part of the checkpoint every reader reads)."""
    return next(e for k, e in index["tensors"].items() if k.startswith("model."))["chunks"][0]


def edit_first_chunk(ckpt: Path, change: Callable[[dict], None]) -> None:
    index = json.loads((ckpt / "index.json").read_text())
    change(weight_chunk(index))
    rewrite(ckpt, "index.json", json.dumps(index).encode())


def flip(path: Path) -> None:
    """Corrupt one byte in the middle of a file (its size unchanged, so only a checksum tells)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_weight(ckpt: Path) -> None:
    """A flipped byte in a model weight's data, which every reader reads (export reads only weights)."""
    chunk = weight_chunk(json.loads((ckpt / "index.json").read_text()))
    data = bytearray((ckpt / chunk["file"]).read_bytes())
    data[chunk["data_offset"]] ^= 0xFF
    (ckpt / chunk["file"]).write_bytes(bytes(data))


def escape_relative(ckpt: Path) -> None:
    (ckpt.parent / "__0_0.distcp").write_bytes(
        (ckpt / "__0_0.distcp").read_bytes()
    )  # a file is there
    edit_first_chunk(ckpt, lambda c: c.update(file="../__0_0.distcp"))


def escape_absolute(ckpt: Path) -> None:
    outside = ckpt.parent / "elsewhere.distcp"
    outside.write_bytes((ckpt / "__0_0.distcp").read_bytes())
    edit_first_chunk(ckpt, lambda c: c.update(file=str(outside)))


def beyond_end(ckpt: Path) -> None:
    size = (ckpt / "__0_0.distcp").stat().st_size
    edit_first_chunk(
        ckpt, lambda c: c.update(offset=size, data_offset=size + c["data_offset"] - c["offset"])
    )


def truncate(ckpt: Path) -> None:
    data = (ckpt / "__0_0.distcp").read_bytes()
    (ckpt / "__0_0.distcp").write_bytes(data[: len(data) // 2])


def link_out(ckpt: Path) -> None:
    outside = ckpt.parent / "config.yaml"
    outside.write_bytes(
        (ckpt / "config.yaml").read_bytes()
    )  # the same bytes: only the link is wrong
    (ckpt / "config.yaml").unlink()
    os.symlink(outside, ckpt / "config.yaml")


def unrecorded_config(ckpt: Path) -> None:
    record = store.marker(ckpt)
    del record["files"]["config.yaml"]
    (ckpt / store.MARKER).write_text(json.dumps(record))


# (damage, the file a message must name, words it says, found on opening (before any data block is read))
CASES = {
    "index path with ..": (escape_relative, "index.json", "../__0_0.distcp", True),
    "index path absolute": (escape_absolute, "index.json", "elsewhere.distcp", True),
    "index offset beyond the file": (beyond_end, "index.json", "__0_0.distcp", True),
    "truncated data file": (truncate, "__0_0.distcp", "truncated", True),
    "flipped byte in a data block": (flip_weight, "__0_0.distcp", "corrupted", False),
    "damaged .metadata": (lambda c: flip(c / ".metadata"), ".metadata", "corrupted", True),
    "damaged config.yaml": (lambda c: flip(c / "config.yaml"), "config.yaml", "corrupted", True),
    "recorded file missing": (lambda c: (c / ".metadata").unlink(), ".metadata", "missing", True),
    "config.yaml a link out": (link_out, "config.yaml", "outside the checkpoint", True),
    "config.yaml not recorded": (unrecorded_config, store.MARKER, "config.yaml", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_reader_refuses_the_same_damage_naming_the_file(
    saved, small_data_dir, tmp_path, capsys, case
):
    damage, name, words, structural = CASES[case]
    damage(saved)
    named = str(saved / name)

    _, problems = store.verify(saved)
    assert any(named in p and words in p for p in problems), problems
    ok, report = inspect.verify_report(saved)
    assert not ok and named in report and words in report
    assert strata_main(["ckpt", "verify", str(saved)]) == 1
    assert named in capsys.readouterr().out

    opened = Checkpoint(saved)  # what --resume and export open: the same structural check
    opened.close()
    assert opened.problems == (problems if structural else [])

    described = inspect.describe(saved)
    assert "DAMAGED" in described and named in described and "model:" not in described

    out = tmp_path / "export"
    assert strata_main(["ckpt", "export", str(saved), str(out)]) == 2
    assert named in capsys.readouterr().err and not out.exists()

    trainer = Trainer(tiny_config(small_data_dir, tmp_path / "b"), start())
    before = {n: p.detach().clone() for n, p in trainer.model.parts[0].named_parameters()}
    with pytest.raises(CheckpointError) as err:
        trainer.resume(saved)
    assert named in str(err.value) and words in str(err.value)
    assert trainer.step == 0 and not trainer.model.optimizer.state
    for n, p in trainer.model.parts[0].named_parameters():
        assert torch.equal(p, before[n]), n


def test_structure_is_checked_on_resume_without_block_checksums(saved, small_data_dir, tmp_path):
    """checkpoint.verify_on_load: false skips the data blocks' checksums, never the structure."""
    escape_relative(saved)
    trainer = Trainer(
        tiny_config(small_data_dir, tmp_path / "b", **{"checkpoint.verify_on_load": False}), start()
    )
    with pytest.raises(CheckpointError, match=r"\.\./__0_0\.distcp"):
        trainer.resume(saved)
    assert trainer.step == 0


def test_an_intact_checkpoint_passes_every_reader(saved, tmp_path):
    assert store.verify(saved)[1] == [] and inspect.verify_report(saved)[0]
    assert Checkpoint(saved).problems == []
    assert strata_main(["ckpt", "export", str(saved), str(tmp_path / "hf")]) == 0


def test_an_index_of_the_wrong_shape_is_one_problem_not_a_crash(saved):
    rewrite(saved, "index.json", b'{"tensors": [], "objects": {}}')
    problems = Checkpoint(saved).problems
    assert problems == store.verify(saved)[1]
    assert problems == [f"{saved / 'index.json'}: not a checkpoint index (a damaged index)"]


def test_a_metadata_sending_dcp_elsewhere_fails_verify(saved, capsys):
    """DCP alone reads where `.metadata` says: verify holds it to the (checked) index, even with a
    checksum recorded to match."""
    from strata.checkpoint import dcp_meta

    index = json.loads((saved / "index.json").read_text())
    weight_chunk(index)["file"] = "../__0_0.distcp"
    rewrite(saved, ".metadata", dcp_meta.to_bytes(dcp_meta.build(index, str(saved))))
    assert strata_main(["ckpt", "verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert f"{saved / '.metadata'}: points DCP at other files or bytes than index.json does" in out


def test_inspect_exits_1_on_a_damaged_checkpoint_like_verify(saved, capsys):
    flip_weight(saved)
    assert strata_main(["ckpt", "inspect", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and str(saved / "__0_0.distcp") in out and "model:" not in out


def test_inspect_exits_0_on_an_intact_checkpoint(saved, capsys):
    assert strata_main(["ckpt", "inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert ": ok (" in out and "model:" in out and "trainer: step 2" in out


@pytest.mark.parametrize("text", ["[]", "3", '"step"', "null", "{not json"])
def test_a_damaged_commit_marker_is_one_clear_problem_everywhere(
    saved, small_data_dir, tmp_path, capsys, text
):
    """A COMMITTED marker that is not a JSON object (or not JSON): verify, inspect and --resume
    refuse it with one error naming it (exit 2, as for any checkpoint they cannot open), and
    retention never deletes it."""
    (saved / store.MARKER).write_text(text)
    named = str(saved / store.MARKER)
    for verb in ("verify", "inspect"):
        assert strata_main(["ckpt", verb, str(saved)]) == 2
        err = capsys.readouterr().err
        assert (
            named in err and "commit marker" in err and "damaged" in err and "Traceback" not in err
        )
    with pytest.raises(CheckpointError, match="commit marker"):
        store.verify(saved)

    trainer = Trainer(tiny_config(small_data_dir, tmp_path / "b"), start())
    with pytest.raises(CheckpointError, match="commit marker") as err:
        trainer.resume(saved)
    assert named in str(err.value) and trainer.step == 0

    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    launch = [
        "launch",
        str(experiment),
        *tiny_overrides(small_data_dir, tmp_path / "c"),
        "--resume",
        str(saved),
    ]
    assert strata_main(launch) == 2  # refused before torchrun starts
    err_text = capsys.readouterr().err
    assert named in err_text and "commit marker" in err_text and "Traceback" not in err_text

    root = saved.parent
    assert store.committed(root) == [saved] and not store.owned(
        saved
    )  # listed, never Strata's to delete
    store.prune(root, keep_last=1, newest=store.step_dir(root, 99))
    assert (saved / store.MARKER).read_text() == text
