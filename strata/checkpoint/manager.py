"""Saving and loading checkpoints from a training job: each rank stages its own pieces of the state
(no gather) into a reusable shared-memory image of its file, and a writer — inline, or a process of
its own with `checkpoint.async` — persists it while training goes on. While a save is in flight,
every step ends with one small all-reduce of the writers' status, so every rank learns together
that the save is written (then rank 0 commits it) or that a writer failed (then every rank raises).

Disk problems: every rank checks at construction that it can create a file in the directory, so an
unwritable `checkpoint.dir` stops the run before its first step rather than at its first save; a save
that finds no room (ENOSPC, EDQUOT, EFBIG) is discarded, leaving the committed checkpoints as they were,
and then stops the run or, with `checkpoint.on_disk_full: retry`, is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from strata.checkpoint import image_check, store, writer
from strata.checkpoint.blob import torch_dtype
from strata.checkpoint.pieces import FixedState, Piece, SavableState, StateContents, whole_piece
from strata.checkpoint.stage import (
    OBJECTS_FILE,
    SharedImage,
    StageCheck,
    Staging,
    index_of,
    objects_blob,
    prepare_image,
    replan,
    stage,
)
from strata.errors import CheckpointError
from strata.parallel import comm
from strata.runlock import locked

WRITING, WRITTEN, DONE = 0, 1, 2
ON_DISK_FULL = ("stop", "retry")


@dataclass(frozen=True)
class MagnitudeBound:
    """A limit on the magnitude of the saved tensors whose keys start with `prefix`."""

    prefix: str
    limit: float


@dataclass(frozen=True)
class _PlanChecks:
    """A plan's checks: which items a magnitude bound measures, as flags per item (checked while
    staging) and as the writer's spans of floating-point boxes (`image_check`), and whether the
    writer can read every such box's dtype."""

    staging: Staging
    bounded: list[bool]
    spans: tuple[image_check.Span, ...]
    checkable: bool

    @classmethod
    def of(cls, staging: Staging, bound: MagnitudeBound | None) -> _PlanChecks:
        """The checks of `staging`'s items under `bound`."""
        bounded = [bound is not None and it.key.startswith(bound.prefix) for it in staging.items]
        floats = [
            (it, b)
            for it, b in zip(staging.items, bounded)
            if torch_dtype(it.dtype).is_floating_point
        ]
        spans = tuple(
            image_check.Span(it.data_offset, it.box.numel, it.dtype, b) for it, b in floats
        )
        return cls(staging, bounded, spans, image_check.checkable([it.dtype for it, _ in floats]))


@dataclass
class _Save:
    """A save in flight."""

    step: int
    commit_args: tuple = ()
    state: int = WRITING
    commit_sent: bool = False
    error: str | None = None
    no_room: bool = False  # the error is a writer's DiskFullError
    verdict: image_check.Verdict | None = None  # the writer refused the image (`image_check`)


class CheckpointManager:
    """Checkpoints under `root` for one rank of a `world` (collective calls over `group`, None in a
    world of one: every rank makes them); `config_yaml` is the run's config, saved with each.
    `on_disk_full` ("stop" or "retry") is what a save that finds no room does. Without `prepare`
    (a job that only loads, as `strata eval`, whose checkpoint.dir a live run may be writing) it
    leaves `root` alone: no probe file, no unfinished saves removed."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world: int,
        keep_last: int = 0,
        async_save: bool = False,
        group=None,
        config_yaml: str = "",
        on_disk_full: str = "stop",
        prepare: bool = True,
    ):
        if on_disk_full not in ON_DISK_FULL:
            raise ValueError(f"on_disk_full must be one of {ON_DISK_FULL}, not {on_disk_full!r}")
        self.root, self.rank, self.world, self.config_yaml = Path(root), rank, world, config_yaml
        self.keep_last, self.async_save, self.group = keep_last, async_save, group
        self.on_disk_full = on_disk_full
        # steps whose save found no room and was skipped (retry): why
        self.skipped: dict[int, str] = {}
        self._staging: Staging | None = None
        self._dsts: list[torch.Tensor] = []  # the staging image's view for each item of the plan
        self._checks: _PlanChecks | None = None  # what a save of the current plan checks
        self._screen: image_check.Screen | None = None  # the writer's checks of the save staged
        self.largest = 0.0  # the largest magnitude a bound measured at the last save, every rank's
        self._refused: tuple[int, image_check.Verdict] | None = None  # see take_refused
        self._inflight: _Save | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        if not prepare:
            return
        self.agree(
            _writable(self.root, rank), f"checkpoint.dir {self.root} cannot hold checkpoints"
        )
        if rank == 0:  # saves an earlier run left unfinished: never loaded, and they fill the disk
            store.clean_partials(self.root)

    # --- collectives (no-ops in a world of one) --------------------------------------------
    def agree(self, problems: list[str], what: str) -> None:
        """Raise the same CheckpointError on every rank if any rank has problems."""
        every = comm.all_gather_objects(problems, self.group)
        found = [
            f"rank {r}: {p}" if self.world > 1 else p for r, ps in enumerate(every) for p in ps
        ]
        if found:
            raise CheckpointError(_listed(what, found))

    def _agree_saved(self, problems: list[str], step: int, no_room: bool = False) -> bool:
        """Whether every rank's part of the save of `step` succeeded (collective; `no_room`: this
        rank's problems are a full disk). When any failed, rank 0 deletes the partial directory
        (every rank has stopped writing by then: the agreement is collective), so failures cannot
        fill the disk; then every rank raises the same error, unless every failure was a full disk
        and `on_disk_full` is "retry": then the save is skipped (False) and rank 0 warns."""
        every = comm.all_gather_objects((problems, no_room), self.group)
        found = [
            f"rank {r}: {p}" if self.world > 1 else p for r, (ps, _) in enumerate(every) for p in ps
        ]
        if not found:
            return True
        if self.rank == 0:
            store.discard_partial(store.partial_dir(self.root, step))
        disk_full = all(full for ps, full in every if ps)
        if disk_full and self.on_disk_full == "retry":
            note = (
                f"checkpoint step {step} was not saved: no room under {self.root}; the checkpoints "
                "committed before it are intact, training goes on and the next checkpoint tries "
                f"again (checkpoint.on_disk_full: retry): {found[0]}"
            )
            self.skipped[step] = note
            if self.rank == 0:
                print(f"strata: warning: {note}", file=sys.stderr, flush=True)
            return False
        what = self._failed(step)
        if disk_full:
            what += (
                "; free space there (or set checkpoint.dir to a larger file system), or set "
                "checkpoint.on_disk_full: retry to train on and try again at the next checkpoint"
            )
        raise CheckpointError(_listed(what, found))

    # --- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: SavableState,
        finite_only: bool = False,
        suspect: bool = False,
        bound: MagnitudeBound | None = None,
    ) -> bool:
        """Save this rank's `state` as checkpoint `step`: its pieces, and rank 0's objects (trainer
        state, optimizer hyper-parameters) as DCP byte entries. Returns once the data is staged
        (async) or committed (sync). With `finite_only`, a state with a non-finite floating-point
        element on any rank is not saved at all: False on every rank, nothing written. That check is
        made on the staged bytes as they are copied, so the state is read once.

        One small all-reduce agrees that every rank's plan still holds (copied optimistically into
        the image first) and, with `finite_only`, that every rank's state is finite. A `suspect`
        save (the run's spike guard fired lately) is marked so: retention keeps the newest checkpoint
        that is not, besides the last `keep_last`.

        With `bound` (and `finite_only`), the largest magnitude of the tensors it names is measured
        as they are staged and agreed in the same all-reduce (`largest` after the call): above the
        bound's limit, nothing is written and the save returns False on every rank.

        An asynchronous save staged on the CPU leaves both checks to the writers instead, so that
        the call stalls for the copy alone: it returns True, and a refused image is discarded at a
        later `poll` on every rank (`take_refused`)."""
        self.wait()
        contents = state.contents(step)
        pieces = contents.pieces
        step_dir = store.partial_dir(self.root, step)
        # files of an interrupted earlier attempt; the others write after the agreement
        if self.rank == 0:
            shutil.rmtree(step_dir, ignore_errors=True)
        staging = self._staging
        same = staging is not None and staging.sources.take(pieces)
        check = StageCheck(finite=False)
        if same:
            assert staging is not None
            check = self._stage(staging, finite_only, bound)
        # one MIN over (plan still holds, finite, -largest magnitude)
        flags = torch.tensor(
            [float(same), float(check.finite), -check.largest], dtype=torch.float64
        )
        comm.all_reduce(flags, self.group, dim="checkpoint", op=dist.ReduceOp.MIN)
        if not flags[0]:  # a first save, or some rank's pieces changed: plan again, copy again
            staging = self._new_plan(pieces)
            check = self._stage(staging, finite_only, bound)
            found = torch.tensor([float(check.finite), -check.largest], dtype=torch.float64)
            if finite_only:
                comm.all_reduce(found, self.group, dim="checkpoint", op=dist.ReduceOp.MIN)
            flags[1:] = found
        self.largest = -float(flags[2])
        if not flags[1] or (bound is not None and self.largest > bound.limit):
            return False
        assert staging is not None  # kept or planned above
        extra: dict[str, bytes] = {}
        commit_args: tuple = ()
        if self.rank == 0:
            blob, where = objects_blob(contents.objects)
            extra = {OBJECTS_FILE: blob}
            index = index_of(step, contents.layout, staging, where, contents.aliases)
            commit_args = (
                step_dir,
                step,
                self.world,
                index,
                self.config_yaml,
                self.keep_last,
                suspect,
            )
        if self.async_save:
            conn = self._start_writer()
            conn.send(("write", step_dir, self.rank, staging.nbytes, extra, self._screen))
            self._inflight = _Save(step, commit_args)
            return True
        self._write_inline(step, step_dir, staging, extra, commit_args)
        return True

    def _stage(
        self, staging: Staging, finite_only: bool, bound: MagnitudeBound | None
    ) -> StageCheck:
        """Copy the state into the image (`stage`). The checks `finite_only` and `bound` ask for are
        made as it copies, or, for an asynchronous save staged on the CPU, left to the writer
        (`image_check`, after save() returns): then `self._screen` says what it checks."""
        checks = self._checks
        if checks is None or checks.staging is not staging:  # once per plan
            checks = self._checks = _PlanChecks.of(staging, bound)
        self._screen = None
        if not finite_only:
            return stage(self._dsts, staging.sources)
        on_cpu = not any(v is not None and v.is_cuda for v in staging.sources.views)
        if self.async_save and checks.checkable and on_cpu:
            self._screen = image_check.Screen(checks.spans, bound.limit if bound else 0.0)
            return stage(self._dsts, staging.sources)
        return stage(self._dsts, staging.sources, True, checks.bounded)

    def _new_plan(self, pieces: list[Piece]) -> Staging:
        """A plan for these pieces (collective) and a staging image for it, templates written."""
        staging = replan(pieces, self.rank, self.group)
        self._stop_writer()  # a writer maps the old image
        self._free_image()
        image = staging.image = SharedImage(staging.nbytes)
        self._dsts = prepare_image(image.tensor, staging.items)
        self._staging = staging
        return staging

    def _free_image(self) -> None:
        self._dsts = []  # views of the image: the mapping cannot close while they live
        if self._staging is not None:
            _image(self._staging).close()
            self._staging = None

    def _write_inline(
        self, step: int, step_dir: Path, staging: Staging, extra: dict, commit_args: tuple
    ) -> None:
        problems: list[str] = []
        no_room = False
        try:
            writer.write_rank(
                step_dir, self.rank, memoryview(_image(staging).map), staging.nbytes, extra
            )
        except Exception as e:  # every rank must reach agree(), whatever went wrong
            problems.append(f"writing {step_dir}: {type(e).__name__}: {e}")
            no_room = isinstance(e, writer.DiskFullError)
        if not self._agree_saved(problems, step, no_room):
            return
        if self.rank == 0:
            try:
                writer.commit(*commit_args)
            except Exception as e:
                problems.append(f"committing {step_dir}: {type(e).__name__}: {e}")
                no_room = isinstance(e, writer.DiskFullError)
        self._agree_saved(problems, step, no_room)

    def _failed(self, step: int) -> str:
        return (
            f"checkpoint step {step} was not saved under {self.root}; the checkpoints committed "
            "before it are intact (`strata ckpt verify` checks one)"
        )

    # --- the writer process ----------------------------------------------------------------
    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid, or None before the first save starts one."""
        return self._proc.pid if self._proc is not None else None

    def _start_writer(self) -> Connection:
        """A writer process of our own (not multiprocessing's spawn, which re-runs the user's main
        module): it inherits the image's memfd and one end of a socket pair, and imports no torch.
        Returns our end of the pair."""
        if self._proc is not None and self._proc.poll() is None:
            assert self._conn is not None  # made with the process
            return self._conn
        staging = self._staging
        assert staging is not None  # save() stages before it starts a writer
        ours, theirs = socket.socketpair()
        fds = (_image(staging).fd, theirs.fileno())
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "strata.checkpoint.writer",
                str(fds[0]),
                str(max(staging.nbytes, 1)),
                str(fds[1]),
            ],
            pass_fds=fds,
        )
        theirs.close()  # else a dead writer's end stays open here and recv() never sees EOF
        conn = self._conn = Connection(ours.detach())
        return conn

    def _stop_writer(self, kill: bool = False) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        assert conn is not None  # made with the process
        try:
            conn.send(None)
        except OSError:
            pass
        if kill:
            proc.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        conn.close()
        self._proc = self._conn = None

    def _check_writer(self, save: _Save) -> None:
        """Take the writer's replies; a dead writer is a failure."""
        proc, conn = self._proc, self._conn
        assert proc is not None and conn is not None  # a save in flight has its writer
        try:
            while save.error is None and conn.poll():
                status, kind, *text = conn.recv()
                if status == "error":
                    save.error = f"{kind} failed: {text[0]}"
                    save.no_room = bool(text[1:] and text[1])
                elif status == "refused":
                    save.verdict, save.state = text[0], DONE
                elif kind == "write":
                    save.state = WRITTEN if self.rank == 0 else DONE
                else:
                    save.state = DONE
        except (EOFError, OSError):
            pass
        if save.error is None and save.state != DONE and proc.poll() is not None:
            save.error = (
                f"the checkpoint writer (pid {proc.pid}) died (exit code {proc.returncode})"
            )

    def poll(self) -> None:
        """Once per training step while a save is in flight (collective): commit it when every
        rank's part is written; raise on every rank if any writer failed."""
        save = self._inflight
        if save is None:
            return
        self._check_writer(save)
        verdict = save.verdict
        flags = torch.tensor(
            [
                float(save.error is not None),
                -save.state,
                float(verdict is not None),
                float(verdict is not None and not verdict.finite),
                verdict.largest if verdict is not None else 0.0,
            ],
            dtype=torch.float64,
        )
        comm.all_reduce(flags, self.group, dim="checkpoint", op=dist.ReduceOp.MAX)
        if flags[0]:
            self._inflight = None
            # it may still be writing this save: a new one starts for the next
            self._stop_writer(kill=True)
            self._agree_saved([save.error] if save.error else [], save.step, save.no_room)
            return
        if flags[2]:  # some rank's image failed its checks: nobody's part of it is kept
            self._inflight = None
            if save.state != DONE:
                self._stop_writer(kill=True)
            comm.barrier(self.group)  # every writer has stopped writing into the directory
            if self.rank == 0:
                store.discard_partial(store.partial_dir(self.root, save.step))
            agreed = image_check.Verdict(finite=not flags[3], largest=float(flags[4]))
            self._refused = (save.step, agreed)
            return
        lowest = -int(flags[1])
        if self.rank == 0 and lowest >= WRITTEN and not save.commit_sent:
            assert self._conn is not None  # a save in flight has its writer
            self._conn.send(("commit", *save.commit_args))
            save.commit_sent = True
        if lowest == DONE:
            self._inflight = None

    def take_refused(self) -> tuple[int, image_check.Verdict] | None:
        """The step and verdict of an asynchronous save whose image the writers refused (some
        element not finite, or a bounded magnitude above its limit), once; nothing of it was kept,
        so the checkpoints committed before it stay the newest."""
        refused, self._refused = self._refused, None
        return refused

    def wait(self) -> None:
        """Until no save is in flight (collective: every rank leaves at the same poll)."""
        while self._inflight is not None:
            self.poll()
            if self._inflight is not None:
                time.sleep(0.005)

    def close(self) -> None:
        """Finish the save in flight, then stop the writer and free the staging image."""
        try:
            self.wait()
        finally:
            self._stop_writer()
            self._free_image()


def _listed(what: str, found: list[str]) -> str:
    return (
        f"{what}:\n  "
        + "\n  ".join(found[:20])
        + (f"\n  … {len(found) - 20} more" if len(found) > 20 else "")
    )


def _writable(root: Path, rank: int) -> list[str]:
    """Problems creating a file in `root` (made if missing): every rank writes its data file there, so
    an unwritable directory is found before the first step, not at the first save. Write and fsync a
    probe file (permissions alone would not tell: root ignores them, read-only mounts and full disks
    refuse only the write)."""
    probe = root / f".probe.rank{rank}.{os.getpid()}"
    if root.exists() and not root.is_dir():
        return [
            f"{root} is not a directory; set checkpoint.dir to a directory every rank can write to"
        ]
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as e:
        name = (
            errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__
        )
        return [
            f"cannot create a file in {root} ({name}: {e.strerror or e}); set checkpoint.dir to a "
            "directory every rank can write to"
        ]
    return []


def _image(staging: Staging) -> SharedImage:
    """The shared-memory image of a staging plan, which `CheckpointManager._stage` gives every plan."""
    assert staging.image is not None
    return staging.image


def write_whole(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    objects: dict,
    aliases: dict[str, str],
    config_yaml: str,
    layout: dict,
    overwrite: bool = False,
    command: str = "strata ckpt",
) -> Path:
    """A checkpoint of whole tensors (by DCP key), written from one process (imports, offline
    tools); the same format a training job writes. It holds `root`'s lock while it writes, refuses a
    `root` holding committed checkpoints unless `overwrite` (`store.output_refusal`), and prunes
    nothing."""
    with locked([(Path(root), "checkpoint directory")]):
        refusal = store.output_refusal(Path(root), step, overwrite, command)
        if refusal is not None:
            raise refusal
        pieces = [whole_piece(key, t.detach().contiguous()) for key, t in tensors.items()]
        CheckpointManager(root, 0, 1, config_yaml=config_yaml).save(
            step, FixedState(StateContents(pieces, objects, aliases, layout))
        )
    return store.step_dir(root, step)
