"""Where a run starts, and putting its state there: the checkpoint a start continues from
(`start_from`), with snapshots on the newest in-memory snapshot every rank can restore
(`restore_on_start`), a checkpoint of any layout loaded into this one (`resume_from`),
`model.init_from`'s weights for a fresh run (`init_weights`); `choose` is all of it, as `strata
train` starts. Before any of it a start takes its run's directories (`lock_run`: one writer per run)
and its snapshot manager (`snapshot_manager`), and asks whether these workers are a restarted
attempt of their job (`restarted_attempt`).

The functions that put a state in place take the trainer's parts they need, as the `Starting`
protocol states them (the `Trainer` is one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from strata.checkpoint import hf_weights, store
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.reader import Checkpoint
from strata.config import Config, SnapshotConfig
from strata.errors import StrataError
from strata.parallel import comm
from strata.parallel.runtime import Runtime
from strata.runlock import RunLocked, RunLocks
from strata.trainer.state import TrainState

if TYPE_CHECKING:
    from strata.checkpoint.dcp_source import DcpCheckpoint
    from strata.checkpoint.snapshot import SnapshotManager


class Starting(Protocol):
    """What starting needs of a trainer: its config and rank, the training state to fill, the
    managers that agree (collectively) and know the checkpoints and snapshots, and the notes rank 0
    prints once the log is open."""

    cfg: Config
    rt: Runtime
    state: TrainState
    checkpoints: CheckpointManager
    snapshots: SnapshotManager | None
    start_notes: list[str]


@dataclass(frozen=True)
class Origin:
    """Where a run started: the checkpoint it resumed (None: none, or a snapshot), the sentence
    saying how snapshots restored it ("" for none), and where its initial weights came from."""

    resumed_from: Path | None
    restore_note: str
    weights_from: Path | None


def choose(trainer: Starting, resume: Path | None) -> Origin:
    """Put `trainer` where this run starts (collective): a snapshot or a checkpoint (a start without
    --resume deliberately continues from the newest one), else for a fresh run model.init_from's
    weights."""
    if trainer.snapshots:
        resumed_from, restore_note = None, restore_on_start(trainer, resume)
    else:
        source = start_from(trainer, resume)
        resumed_from, restore_note = resume_from(trainer, source) if source else None, ""
    fresh = trainer.state.step == 0 and resumed_from is None
    weights_from = init_weights(trainer) if fresh and trainer.cfg.model.init_from else None
    return Origin(resumed_from, restore_note, weights_from)


def restarted_attempt() -> bool:
    """Whether these workers continue this job's own earlier attempt: torchrun restarted them after a
    failure (`strata launch --max-restarts`), or Slurm requeued the job (after a preemption, or the
    script's own requeue on PREEMPTED_EXIT) and started it again."""
    counts = (
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        os.environ.get("SLURM_RESTART_COUNT", "0"),
    )
    return any(int(count or "0") > 0 for count in counts)


def lock_run(writes: list[tuple[Path, str]], rank: int, notes: list[str]) -> RunLocks | None:
    """Rank 0 takes the locks of `writes` (the run directory and checkpoint.dir) for the whole job
    (one job holds them, not each rank; their warnings join `notes`); every rank learns whether it
    could (collective), so a second writer of the same run ends on every rank with the one message
    naming the holder."""
    locks, refusal = None, None
    if rank == 0:
        try:
            locks = RunLocks(writes).acquire()
            notes += locks.warnings
        except StrataError as e:
            refusal = str(e)
    refusal = comm.all_gather_objects(refusal, comm.world_group())[0]
    if refusal is not None:
        raise RunLocked(refusal)
    return locks


def snapshot_manager(
    cfg: SnapshotConfig, rt: Runtime, group, notes: list[str]
) -> SnapshotManager | None:
    """The snapshot manager (collective). Workers restarted after a failure go on without
    snapshots, from the newest disk checkpoint, when the agents are out of reach (the launcher
    gave up restarting one that kept dying): a run that snapshots must not die of its agent."""
    # the agent protocol loads only when snapshots are on
    from strata.checkpoint.snapshot import AgentUnreachable, SnapshotManager

    try:
        return SnapshotManager(cfg, rt.rank, rt.world_size, group)
    except AgentUnreachable as e:
        if not restarted_attempt():
            raise
        notes.append(
            f"warning: {e}: this attempt runs without in-memory snapshots, from the newest "
            "disk checkpoint"
        )
        return None


def start_from(trainer: Starting, resume: Path | None) -> Path | None:
    """Without snapshots, the checkpoint this run starts from (collective): for workers torchrun
    restarted after a failure or a job Slurm requeued, the newest committed checkpoint under
    checkpoint.dir (this job's own, newer than the `--resume` it was submitted with); else
    `resume`; else none, from step 0. Committed checkpoints in
    checkpoint.dir at a first start belong to an earlier run, which a new one would replace as
    `keep_last` prunes: refused unless checkpoint.overwrite. Only rank 0 looks, since only it
    commits (its view is the one sure to hold the markers); every rank acts on its view."""
    restarted = restarted_attempt()
    if resume is not None and not restarted:
        return resume
    root = trainer.cfg.checkpoint_dir()
    found = [p.name for p in store.committed(root)] if trainer.rt.rank == 0 else []
    found = comm.all_gather_objects(found, trainer.checkpoints.group)[0]
    if not found:
        return resume
    if restarted:  # newer than `resume`: this job's own progress since it started from there
        return root
    if trainer.cfg.checkpoint.overwrite:
        return None
    raise store.earlier_run_error(root, found)


def restore_on_start(trainer: Starting, resume: Path | None) -> str:
    """With snapshots on, where this run starts from (collective): the newest in-memory snapshot
    every rank can restore; else `resume`, or the newest committed checkpoint under
    checkpoint.dir (a job whose every node was lost is simply launched again); else step 0.
    Returns the sentence saying which, and why ("" for a first start)."""
    if trainer.snapshots is None:
        raise RuntimeError("snapshot.every_steps is 0: this run takes no snapshots")
    found = trainer.snapshots.recover()
    if found.checkpoint is not None:
        _load(trainer, found.checkpoint)
        return f"snapshot: resumed from {found.message}"
    checkpoint_dir = trainer.cfg.checkpoint_dir()
    own = checkpoint_dir if store.committed(checkpoint_dir) else None
    disk = (own or resume) if restarted_attempt() else (resume or own)
    lead = f"snapshot: no in-memory snapshot every rank can restore ({found.message})"
    if disk is None:
        return (
            ""
            if not found.restarted
            else f"{lead}; no committed checkpoint under {checkpoint_dir} either: "
            "starting from step 0"
        )
    return f"{lead}; resumed from disk checkpoint {resume_from(trainer, disk)}"


def resume_from(trainer: Starting, path: Path) -> Path:
    """Load a checkpoint saved from any layout into this one (see `TrainState.load`); returns the
    step directory it read."""
    return _load(trainer, _open(trainer, path))


def init_weights(trainer: Starting) -> Path:
    """Load model.init_from's weights (collective): a Hugging Face model directory, read with
    each rank taking only its own boxes of the safetensors, or a Strata or DCP checkpoint's; then
    model.lora.init_from's adapters (a PEFT adapter directory) onto them."""
    path = Path(trainer.cfg.model.init_from or "")
    is_hf = (path / "config.json").is_file()
    ckpt = hf_weights.open_weights(path, trainer.cfg.model) if is_hf else _open(trainer, path)
    trainer.state.load_weights(ckpt, trainer.checkpoints.agree)
    lora = trainer.cfg.model.lora
    if lora.init_from:
        adapter = hf_weights.open_adapter(Path(lora.init_from), lora.rank, lora.alpha)
        trainer.state.load_adapters(adapter, trainer.checkpoints.agree)
    return ckpt.path


def _load(trainer: Starting, ckpt: Checkpoint | DcpCheckpoint) -> Path:
    verify = trainer.cfg.checkpoint.verify_on_load
    path = trainer.state.load(ckpt, verify, trainer.checkpoints.agree)
    trainer.start_notes += trainer.state.notes
    trainer.state.notes.clear()
    return path


def _open(trainer: Starting, path: Path) -> Checkpoint | DcpCheckpoint:
    """A Strata checkpoint, or one torch.distributed.checkpoint wrote alone (its notes say what
    is taken from it and what starts fresh)."""
    if not store.is_dcp_only(path):
        return Checkpoint(path)
    # torch.distributed.checkpoint takes ~1.3 s to import (DTensor, sympy): only runs that read
    # one pay
    from strata.checkpoint.dcp_source import DcpCheckpoint

    ckpt = DcpCheckpoint(path, trainer.cfg.model)
    trainer.start_notes += [f"{path}: a checkpoint DCP wrote alone: {note}" for note in ckpt.notes]
    return ckpt
