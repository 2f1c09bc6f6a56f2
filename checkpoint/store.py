"""Checkpoint directories: one per step under a root, complete only once its COMMITTED marker exists.

Layout of ROOT/step_00000100/ (torch.distributed.checkpoint's, so DCP can read it):
`__{rank}_0.distcp` (each rank's boxes of the global tensors, as torch.save blobs), `__0_1.distcp`
(trainer state and optimizer hyper-parameters), `.metadata` (DCP's index), `index.json` (Strata's
index, the same content as JSON), `config.yaml`, and COMMITTED (JSON: step, each file's size and
CRC-32s), written last. A directory without COMMITTED is never loaded.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from checkpoint import integrity
from trainer.errors import CheckpointError

MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed checkpoints (0: keep all); directories
    without a commit marker (a save in progress or interrupted) are never touched."""
    if keep_last:
        for old in committed(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(dirs, key=lambda p: p.name)


def resolve(path: Path) -> Path:
    """A committed checkpoint directory from either itself or a root holding step_* directories."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(f"{path} has no {MARKER} marker: the save did not finish; resume from an earlier "
                              "checkpoint or from its parent directory (which picks the latest committed one)")
    found = committed(path)
    if not found:
        raise CheckpointError(f"--resume {path}: no committed checkpoint there; pass a run's checkpoint directory "
                              "(e.g. runs/NAME/checkpoints) or one of its step_* directories")
    return found[-1]


def marker(ckpt: Path) -> dict:
    """The commit marker of a committed checkpoint directory: step, and the file manifest."""
    try:
        return json.loads((Path(ckpt) / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{Path(ckpt) / MARKER}: unreadable commit marker ({e}); the checkpoint is damaged, "
                              "resume from another one") from e


def verify(path: Path) -> tuple[Path, list[str]]:
    """The committed checkpoint `path` resolves to, and every integrity problem of its files."""
    ckpt = resolve(path)
    return ckpt, integrity.problems(ckpt, marker(ckpt).get("files", {}))
