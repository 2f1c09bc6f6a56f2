"""Strata never destroys data it did not write: `strata data prepare` refuses an --out that would
replace the user's files or inputs, `strata ckpt export` writes only the files OUT names, never
into a checkpoint and never a config that fails its checksum, and checkpoint saves, retention and
clean-up touch only checkpoints Strata committed and its own partial directories; `strata eval`
into a run that is still training is refused (its lock), and beside it only reads its checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.pieces import FixedState, Piece, StateContents
from strata.data.prepare import expand_inputs, prepare
from strata.errors import CheckpointError, DataError
from strata.launch.cli import main as strata_main
from strata.parallel.flat import Box

from conftest import run_cli, tiny_overrides

TEXT = {
    "a.txt": "first document\n" * 20,
    "b.txt": "second document\n" * 20,
    "c.txt": "third\n" * 30,
}


def corpus(root: Path) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in TEXT.items():
        (root / name).write_text(text)
    return sorted(root.iterdir())


def contents(root: Path) -> dict[str, bytes]:
    """Every file under root by relative path, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# --- data prepare ---------------------------------------------------------------------------


def test_prepare_into_the_input_directory_is_refused_and_keeps_the_corpus(tmp_path, capsys):
    src = tmp_path / "books"
    corpus(src)
    before = contents(src)
    assert strata_main(["data", "prepare", str(src), "--out", str(src)]) == 2
    err = capsys.readouterr().err
    assert "lies inside the input directory" in err and "outside the inputs" in err
    assert contents(src) == before


def test_prepare_into_an_existing_file_is_refused(tmp_path, capsys):
    files = corpus(tmp_path / "src")
    precious = tmp_path / "notes.txt"
    precious.write_text("my notes")
    with pytest.raises(DataError, match="existing file, not a directory"):
        prepare(files, precious, root=tmp_path / "src")
    assert precious.read_text() == "my notes"
    assert strata_main(["data", "prepare", str(tmp_path / "src"), "--out", str(precious)]) == 2
    assert "existing file" in capsys.readouterr().err and precious.read_text() == "my notes"


def test_prepare_into_a_directory_of_other_files_is_refused(tmp_path):
    files = corpus(tmp_path / "src")
    out = tmp_path / "data"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(DataError, match=r"not empty and not an earlier .*thesis\.tex"):
        prepare(files, out, root=tmp_path / "src")
    assert contents(out) == {"thesis.tex": b"years of work"}


def test_prepare_will_not_replace_an_earlier_output_with_extra_files_or_a_foreign_meta(tmp_path):
    files = corpus(tmp_path / "src")
    out = tmp_path / "tok"
    prepare(files, out, root=tmp_path / "src")
    (out / "notes.md").write_text("the user's")
    with pytest.raises(DataError, match="notes.md"):
        prepare(files, out, root=tmp_path / "src")
    assert (out / "notes.md").read_text() == "the user's"

    hand_made = (
        tmp_path / "nanogpt"
    )  # a nanoGPT-style directory the user made: same names, their meta
    hand_made.mkdir()
    (hand_made / "train.bin").write_bytes(b"\x01\x00" * 8)
    (hand_made / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 50257}))
    with pytest.raises(DataError, match="meta.json is not one `strata data prepare` wrote"):
        prepare(files, hand_made, root=tmp_path / "src")
    assert (hand_made / "train.bin").read_bytes() == b"\x01\x00" * 8
    (hand_made / "meta.json").unlink()
    with pytest.raises(DataError, match="it has no meta.json"):
        prepare(files, hand_made, root=tmp_path / "src")
    assert (hand_made / "train.bin").read_bytes() == b"\x01\x00" * 8


def test_prepare_replaces_an_empty_directory_or_its_own_earlier_output(tmp_path):
    files = corpus(tmp_path / "src")
    out = tmp_path / "tok"
    out.mkdir()
    first = prepare(files, out, val_fraction=0.3, root=tmp_path / "src")
    again = prepare(files[:2], out, val_fraction=0.3, root=tmp_path / "src")
    assert (first["documents"], again["documents"]) == (3, 2)
    assert json.loads((out / "meta.json").read_text())["documents"] == 2


def test_output_inside_an_input_directory_is_refused_even_on_the_first_run(tmp_path):
    src = tmp_path / "src"
    corpus(src)
    with pytest.raises(DataError, match="would tokenize its own output"):
        expand_inputs([str(src)], out_dir=src / "tok")
    assert not (src / "tok").exists()
    files, root = expand_inputs([str(src)], out_dir=tmp_path / "tok")  # beside the inputs: fine
    assert len(files) == 3 and root == src.resolve()


def test_an_input_file_inside_the_output_is_refused(tmp_path):
    files = corpus(tmp_path / "src")
    out = tmp_path / "tok"
    prepare(files, out, root=tmp_path / "src")
    with pytest.raises(DataError, match="lies inside --out"):
        prepare([out / "meta.json"], out)
    assert json.loads((out / "meta.json").read_text())["documents"] == 3


# --- checkpoint retention and partial directories --------------------------------------------


def save(mgr: CheckpointManager, step: int) -> None:
    t = torch.full((4, 3), float(step))
    piece = Piece("model.w", (4, 3), Box((0, 0), (4, 3)), t)
    mgr.config_yaml = "model: {}\n"
    mgr.save(
        step, FixedState(StateContents([piece], {"trainer": {"step": step}}, {}, {"world": 1}))
    )


def lookalike(root: Path, name: str, marker: dict | None = None) -> Path:
    """A user's directory named like a checkpoint, holding a file of theirs (and, if given, a
    COMMITTED file and an index.json of their own)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "results.csv").write_text("precious")
    if marker is not None:
        (d / store.MARKER).write_text(json.dumps(marker))
        (d / "index.json").write_text("{}")
    return d


@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)]
)  # a writer process: ~8 s
def test_a_save_never_replaces_a_users_lookalike_directory_and_leaves_no_partial(
    tmp_path, async_save
):
    user = lookalike(tmp_path, "step_00000001")
    mgr = CheckpointManager(tmp_path, 0, 1, keep_last=1, async_save=async_save)
    with pytest.raises(
        CheckpointError, match=r"step_00000001 exists and is not a checkpoint Strata committed"
    ):
        save(mgr, 1)
        mgr.wait()
    assert (user / "results.csv").read_text() == "precious"
    assert not store.partial_dir(tmp_path, 1).exists()  # the failed save cleaned up after itself
    save(mgr, 2)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_retention_deletes_only_checkpoints_strata_committed(tmp_path):
    plain = lookalike(tmp_path, "step_00000001")
    mismatched = lookalike(
        tmp_path, "step_00000002", marker={"step": 9, "time": 0.0}
    )  # not this step's
    outside = lookalike(tmp_path / "elsewhere", "data")
    (tmp_path / "step_00000003").symlink_to(outside)
    mgr = CheckpointManager(tmp_path, 0, 1, keep_last=1)
    for step in (4, 5, 6):
        save(mgr, step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "elsewhere",
        "step_00000001",
        "step_00000002",
        "step_00000003",
        "step_00000006",
    ]
    for d in (plain, mismatched, outside):
        assert (d / "results.csv").read_text() == "precious"
    assert (mismatched / store.MARKER).is_file()
    assert store.owned(tmp_path / "step_00000006") and not store.owned(mismatched)


def test_partial_directories_of_interrupted_saves_are_cleaned_at_start(tmp_path):
    interrupted = store.partial_dir(tmp_path, 7)
    interrupted.mkdir(parents=True)
    (interrupted / "__0_0.distcp").write_bytes(b"\0" * 4096)
    kept = [
        lookalike(tmp_path, ".step_7.partial"),
        lookalike(tmp_path, ".step_00000008.partial.bak"),
    ]
    (tmp_path / ".step_00000009.partial").symlink_to(lookalike(tmp_path / "elsewhere", "data"))
    CheckpointManager(tmp_path, 1, 2)  # only rank 0 cleans
    assert interrupted.is_dir()
    CheckpointManager(tmp_path, 0, 1)
    assert not interrupted.exists()
    assert all((d / "results.csv").read_text() == "precious" for d in kept)
    assert (tmp_path / ".step_00000009.partial" / "results.csv").read_text() == "precious"


# --- ckpt export -----------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A committed checkpoint of one small weight, saved inline (no writer process)."""
    mgr = CheckpointManager(tmp_path / "ckpts", 0, 1)
    save(mgr, 3)
    mgr.close()
    return store.step_dir(tmp_path / "ckpts", 3)


def test_export_to_a_file_keeps_a_config_yaml_beside_it_and_needs_overwrite_to_replace(
    ckpt, tmp_path, capsys
):
    from safetensors.torch import load_file

    mine = tmp_path / "config.yaml"
    mine.write_text("my own experiment\n")
    out = tmp_path / "w.safetensors"
    assert strata_main(["ckpt", "export", str(ckpt), str(out)]) == 0
    assert mine.read_text() == "my own experiment\n"
    assert (tmp_path / "w.config.yaml").read_text() == "model: {}\n"
    assert torch.equal(load_file(out)["w"], torch.full((4, 3), 3.0))
    capsys.readouterr()

    assert strata_main(["ckpt", "export", str(ckpt), str(out)]) == 2  # both exist now
    assert "--overwrite" in capsys.readouterr().err
    assert strata_main(["ckpt", "export", str(ckpt), str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("where", ["step dir", "inside step dir", "checkpoints root"])
def test_export_into_a_checkpoint_is_refused_and_the_checkpoint_stays_intact(ckpt, capsys, where):
    out = {
        "step dir": ckpt,
        "inside step dir": ckpt / "sub" / "w.safetensors",
        "checkpoints root": ckpt.parent,
    }[where]
    before = contents(ckpt.parent)
    assert strata_main(["ckpt", "export", str(ckpt), str(out), "--overwrite"]) == 2
    assert "is in the checkpoint directory" in capsys.readouterr().err
    assert contents(ckpt.parent) == before
    assert store.verify(ckpt)[1] == []


def test_export_refuses_a_config_that_fails_its_checksum(ckpt, tmp_path, capsys):
    (ckpt / "config.yaml").write_text("model: []\n")  # the same length: only the checksum tells
    assert strata_main(["ckpt", "export", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{ckpt / 'config.yaml'}: does not match the checksum" in err
        and "nothing was exported" in err
    )
    assert not (tmp_path / "hf").exists()


def test_export_to_an_existing_file_without_the_suffix_is_refused(ckpt, tmp_path):
    from strata.checkpoint.export import export

    precious = tmp_path / "notes"
    precious.write_text("mine")
    with pytest.raises(CheckpointError, match="is an existing file"):
        export(ckpt, precious)
    assert precious.read_text() == "mine"


# --- eval --out ------------------------------------------------------------------------------

EVAL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def eval_argv(tmp_path: Path, config: Path, out: Path) -> list[str]:
    """`strata eval` writing to `out`: refused before the checkpoint (which need not exist) is read."""
    resume = str(tmp_path / "nope")
    return [
        "eval",
        str(config),
        f"log.dir={tmp_path / 'runs'}",
        "--resume",
        resume,
        "--out",
        str(out),
    ]


@pytest.mark.parametrize(
    "where", ["config", "val.bin", "file in step dir", "checkpoints root", "user file"]
)
def test_eval_out_never_replaces_what_eval_did_not_write(ckpt, tmp_path, capsys, where):
    config = tmp_path / "exp.yaml"
    config.write_text("train: {steps: 2}\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.bin").write_bytes(b"\1\0" * 100)
    (data / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 257}')
    (tmp_path / "notes.json").write_text('{"mine": true}\n')
    out = {
        "config": config,
        "val.bin": data / "val.bin",
        "file in step dir": ckpt / "config.yaml",
        "checkpoints root": ckpt.parent / "eval.json",
        "user file": tmp_path / "notes.json",
    }[where]
    before = contents(tmp_path)
    assert strata_main(eval_argv(tmp_path, config, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "nothing was evaluated or written" in err, err
    assert "Traceback" not in err
    assert contents(tmp_path) == before
    assert store.verify(ckpt)[1] == []


def test_eval_out_replaces_its_own_earlier_output(tmp_path):
    from strata import config
    from strata.launch.commands.eval import _write, check_out

    cfg = config.load(EVAL_CONFIG, [f"log.dir={tmp_path / 'runs'}"])
    out = tmp_path / "eval.json"
    _write(cfg, out, {"step": 2, "checkpoint": "c", "splits": {}}, 2, {})
    assert json.loads(out.read_text())["written_by"] == "strata eval"
    check_out(out, EVAL_CONFIG)  # its own: fine
    out.write_text(json.dumps({"step": 2, "checkpoint": "c", "splits": {}}))
    check_out(out, EVAL_CONFIG)  # written before the marker: fine too
    out.write_text(json.dumps({"step": 2, "checkpoint": "c", "splits": {}, "mine": 1}))
    with pytest.raises(Exception, match="strata eval did not write"):
        check_out(out, EVAL_CONFIG)


# --- eval into a live run ------------------------------------------------------------------------


def hold_run_lock(directory: Path) -> subprocess.Popen:
    """Another process holding `directory`'s run lock, as a run still training there does, until its
    stdin closes."""
    code = (
        "import sys; from pathlib import Path; from strata.runlock import RunLocks\n"
        "RunLocks([(Path(sys.argv[1]), 'run directory')]).acquire()\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def release(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)


def live_run_files(run_dir: Path) -> None:
    """What a run still training has written so far: metrics, an earlier evaluation, and a save in
    progress (a partial directory a checkpoint manager's start-up would remove)."""
    partial = run_dir / "checkpoints" / ".step_00000004.partial"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"\1" * 4096)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.1}\n')
    (run_dir / "eval.json").write_text(
        json.dumps({"written_by": "strata eval", "step": 0, "checkpoint": "c", "splits": {}})
    )


def test_eval_into_a_run_that_is_still_training_is_refused_and_writes_nothing(
    small_data_dir, tmp_path, capsys, monkeypatch
):
    from strata.launch import torchrun

    run_dir = tmp_path / "t"
    live_run_files(run_dir)
    experiment = tmp_path / "e.yaml"
    experiment.write_text("{}\n")
    common = [
        str(experiment),
        *tiny_overrides(small_data_dir, tmp_path),
        "--resume",
        str(run_dir / "checkpoints"),
    ]
    monkeypatch.setattr(torchrun, "run_local", lambda *args: pytest.fail("workers started"))
    holder = hold_run_lock(run_dir)
    try:
        before = contents(tmp_path)
        for argv in (
            ["eval", *common],
            ["eval", *common, "--out", str(tmp_path / "elsewhere.json")],
            ["launch", *common, "--eval", "--nproc", "2"],  # before any worker starts
        ):
            code, said = run_cli(argv, capsys)
            assert code == 2, said
            assert f"the run directory {run_dir} is in use by pid {holder.pid} on host" in said
            assert "nothing was evaluated or written" in said and "log.name=t-eval" in said, said
            assert "Traceback" not in said
            assert contents(tmp_path) == before
    finally:
        release(holder)


@pytest.mark.slow  # a tiny training run, then a whole-split evaluation
def test_eval_beside_a_live_run_reads_its_checkpoint_and_leaves_its_files_alone(
    small_data_dir, tmp_path, capsys
):
    from worlds import train_run

    small = {"model.seq_len": 128, "train.micro_batch_size": 8}  # few windows, few micro-batches
    train_run(
        small_data_dir, tmp_path, 1, **small, **{"checkpoint.save_final": True, "train.steps": 2}
    )
    run_dir = tmp_path / "t"
    ckpt = run_dir / "checkpoints"
    (ckpt / ".step_00000004.partial").mkdir()  # the live run's save in progress
    (ckpt / ".step_00000004.partial" / "__0_0.distcp").write_bytes(b"\1" * 4096)
    experiment = tmp_path / "e.yaml"
    experiment.write_text("{}\n")
    holder = hold_run_lock(run_dir)
    try:
        before = contents(run_dir)
        # the fix the refusal names: a run directory of its own; checkpoint.dir still the live
        # run's (set in a shared config), which an evaluation only reads
        code, said = run_cli(
            [
                "eval",
                str(experiment),
                *tiny_overrides(small_data_dir, tmp_path, **small),
                f"checkpoint.dir={ckpt}",
                "log.name=t-eval",
                "--resume",
                str(ckpt),
                "--data",
                str(small_data_dir),
            ],
            capsys,
        )
        assert code == 0, said
        assert contents(run_dir) == before
    finally:
        release(holder)
    document = json.loads((tmp_path / "t-eval" / "eval.json").read_text())
    assert document["step"] == 2 and document["splits"][str(small_data_dir)]["sequences"] > 0
