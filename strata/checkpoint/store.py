"""Checkpoint directories: one per step under a root, complete only once its COMMITTED marker exists.

Layout of ROOT/step_00000100/ (torch.distributed.checkpoint's, so DCP can read it):
`__{rank}_0.distcp` (each rank's boxes of the global tensors, as torch.save blobs), `__0_1.distcp`
(trainer state and optimizer hyper-parameters), `.metadata` (DCP's index), `index.json` (Strata's
index, the same content as JSON), `config.yaml`, and COMMITTED (JSON: step, time, each file's size
and CRC-32s), written last. The ranks write into ROOT/.step_00000100.partial, which is renamed into
place once committed; a directory without COMMITTED is never loaded.

Only directories Strata made are ever replaced or deleted: committed checkpoints it recognises as
its own (`owned`) and its `.step_*.partial` directories; anything else under ROOT is the user's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from strata.atomic import fsync_path
from strata.checkpoint import integrity
from strata.errors import CheckpointError

MARKER = integrity.MARKER  # the commit marker's file name
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_PARTIAL_DIR = re.compile(r"^\.step_\d{8}\.partial$")
# how a commit marker that is JSON but not an object is described
_JSON_KINDS: dict[type, str] = {
    list: "array",
    int: "number",
    float: "number",
    str: "string",
    bool: "boolean",
    type(None): "null",
}


def step_dir(root: Path, step: int) -> Path:
    """The directory of committed checkpoint `step` under `root` (step_NNNNNNNN)."""
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    """Where the ranks write checkpoint `step` until it is committed and renamed to `step_dir`."""
    return Path(root) / f".step_{step:08d}.partial"


def data_file(rank: int) -> str:
    """A rank's data file (DCP's FileSystemWriter naming: prefix __{rank}_, one file per rank)."""
    return f"__{rank}_0.distcp"


def owned(path: Path) -> bool:
    """Whether `path` is a checkpoint Strata committed: a real directory (not a link) named
    step_N with index.json and a COMMITTED marker recording step N. Retention and re-saves replace
    or delete only these, so a user's directory that merely looks like one is never touched."""
    path = Path(path)
    name = _STEP_DIR.match(path.name)
    if (
        name is None
        or path.is_symlink()
        or not path.is_dir()
        or not (path / "index.json").is_file()
    ):
        return False
    try:
        record = marker(path)
    except CheckpointError:
        return False
    return isinstance(record, dict) and record.get("step") == int(name.group(1))


def is_dcp_only(path: Path) -> bool:
    """A directory DCP wrote that is not a Strata checkpoint (no commit marker, no index)."""
    path = Path(path)
    return (
        (path / DCP_METADATA).is_file()
        and not (path / MARKER).exists()
        and not (path / "index.json").exists()
    )


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is how Strata names a checkpoint directory (step_N) or a save in progress."""
    return bool(_STEP_DIR.match(name) or _PARTIAL_DIR.match(name))


def is_partial(path: Path) -> bool:
    """Whether `path` is one of Strata's own in-progress save directories (.step_N.partial)."""
    path = Path(path)
    return bool(_PARTIAL_DIR.match(path.name)) and path.is_dir() and not path.is_symlink()


def discard_partial(path: Path) -> None:
    """Delete a failed save's partial directory (nothing else: a path not named like one is kept)."""
    if is_partial(path):
        shutil.rmtree(path, ignore_errors=True)


def clean_partials(root: Path) -> list[Path]:
    """Delete the partial directories interrupted saves left under root (they are never loaded, and
    would fill the disk); returns them."""
    root = Path(root)
    found = [p for p in root.iterdir() if is_partial(p)] if root.is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def publish(partial: Path, final: Path) -> None:
    """Rename a committed partial directory into place; a committed checkpoint of the same step
    already there (from a run resumed from an earlier step) is replaced, anything else there is
    refused."""
    old = final.with_name(f".{final.name}.replaced")
    if (final.exists() or final.is_symlink()) and not owned(final):
        raise CheckpointError(
            f"{final} exists and is not a checkpoint Strata committed (no COMMITTED marker for "
            "step "
            f"{final.name[5:].lstrip('0') or 0} beside an index.json), so it is not replaced; "
            "move it out of "
            f"{final.parent}, or set checkpoint.dir to another directory"
        )
    if final.exists():
        _remove(old)
        os.rename(final, old)
    os.rename(partial, final)
    fsync_path(final.parent)
    _remove(old)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory, its commit marker first, so a crash halfway leaves a directory
    that is not taken for a committed checkpoint."""
    if not path.exists():
        return
    try:
        (path / MARKER).unlink()
        fsync_path(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep_last: int, newest: Path) -> None:
    """Delete the least recently committed checkpoints until `keep_last` remain (0: keep all),
    never `newest` (the one just committed) nor the newest one not marked suspect (saved before the
    run's spike guard last fired: keep-last-good); directories Strata does not own are never touched."""
    if keep_last:
        others = [p for p in committed(root) if p != newest and owned(p)]
        good = [p for p in [*others, newest] if not _suspect(p)]
        last_good = good[-1] if good else None
        for old in others[: max(0, len(others) - (keep_last - 1))]:
            if old != last_good:
                _remove(old)


def _suspect(ckpt: Path) -> bool:
    """Whether a committed checkpoint was saved while its run's spike guard had fired lately."""
    try:
        return bool(marker(ckpt).get("suspect"))
    except CheckpointError:
        return False


def commit_time(ckpt: Path) -> float:
    """When checkpoint `ckpt` was committed (its marker's time); 0.0 for an unreadable marker."""
    try:
        return float(marker(ckpt).get("time", 0.0))
    except CheckpointError:  # an unreadable marker sorts first; loading it reports the damage
        return 0.0


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under root, least recently committed first (a run resumed
    from step 3 that commits step 5 makes step 5 the latest, not an older run's step 6)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(dirs, key=lambda p: (commit_time(p), p.name))


def earlier_run_error(root: Path, found: list[str]) -> CheckpointError:
    """The refusal of a new run in a checkpoint directory that holds `found`, an earlier run's
    committed checkpoints (oldest first), which the new run's saves and `keep_last` would replace."""
    return CheckpointError(
        f"checkpoint.dir {root} holds {len(found)} committed checkpoint(s) of an earlier run "
        "(newest: "
        f"{found[-1]}), which a new run would replace: continue that run with --resume {root}, set "
        "checkpoint.overwrite=true to start afresh and replace them, or choose another "
        "checkpoint.dir "
        "(or log.name)"
    )


def output_refusal(
    root: Path, step: int | None, overwrite: bool, command: str
) -> CheckpointError | None:
    """Why a command that writes checkpoints outside a training job (an import, a reshard) must not
    write under `root`: it holds committed checkpoints of another run and `--overwrite` was not
    given. With it, the command replaces only the step directory it writes (`step`, when known) and
    removes nothing else: such commands never prune."""
    found = [p.name for p in committed(root)]
    if not found or overwrite:
        return None
    clash = ""
    if step is not None and step_dir(root, step).exists():
        clash = f"; {step_dir(root, step).name} would be replaced"
    return CheckpointError(
        f"{command}: {root} already holds {len(found)} committed checkpoint(s) (newest: "
        f"{found[-1]}){clash}. Give an empty or new directory, or --overwrite to write beside them "
        "(only the step this command writes is replaced; nothing else is removed)"
    )


def resolve(path: Path) -> Path:
    """A committed checkpoint directory from either itself or a root holding step_* directories."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(
            f"{path} has no {MARKER} marker: the save did not finish; resume from an earlier "
            "checkpoint or from its parent directory (which picks the latest committed one)"
        )
    found = committed(path)
    if not found:
        raise CheckpointError(
            f"{path}: no committed checkpoint there; pass a run's checkpoint directory "
            "(e.g. runs/NAME/checkpoints) or one of its step_* directories"
        )
    return found[-1]


def marker(ckpt: Path) -> dict:
    """The commit marker of a committed checkpoint directory: step, and the file manifest. Raises
    CheckpointError for a marker that cannot be read or is not a JSON object (a damaged commit)."""
    path = Path(ckpt) / MARKER
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: unreadable commit marker ({e}); the checkpoint is damaged, resume from "
            "another one"
        ) from e
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{path}: damaged commit marker (it holds a JSON "
            f"{_JSON_KINDS.get(type(record), 'value')}, not an object); "
            "the checkpoint is damaged, resume from another one"
        )
    return record


def verify(path: Path) -> tuple[Path, list[str]]:
    """The committed checkpoint `path` resolves to, and every integrity problem of it: the structural
    check every load makes (`integrity.checkpoint_problems`), and every data block's checksum."""
    ckpt = resolve(path)
    return ckpt, integrity.checkpoint_problems(ckpt, marker(ckpt), checksums=True)[1]
