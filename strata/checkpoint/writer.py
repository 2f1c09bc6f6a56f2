"""Persisting a rank's staged checkpoint file, and committing a checkpoint. Runs inline (synchronous
saves) or in a writer process per rank (`python -m strata.checkpoint.writer`, for `checkpoint.async`),
which maps the staging image (a memfd) and persists it while training goes on.

Data files are written with O_DIRECT where the file system allows it (on this class of disk a
buffered write plus fsync was 2–4× slower, docs/design/checkpoint.md §3.3), fsynced, and their
256 KiB-block CRC-32Cs recorded in a per-rank manifest; the commit (rank 0) merges the manifests into the
COMMITTED marker, written last, after `index.json` and DCP's `.metadata`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from strata.atomic import write_file_atomic
from strata.checkpoint import image_check, integrity, store

CHUNK = 16 * integrity.BLOCK  # a whole number of checksum blocks, so chunks' block CRCs line up
DELAY_ENV = "STRATA_CKPT_TEST_WRITE_DELAY_S"  # tests: a slow writer, to kill it mid-save


# The errors that mean "no room": `checkpoint.on_disk_full` decides what they do, unlike other
# failures.
NO_ROOM = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file would outgrow the size this process (ulimit -f) or the file system "
    "allows",
}


class DiskFullError(OSError):
    """A write that found no room (ENOSPC, EDQUOT, EFBIG), its message naming the file and the bytes that
    could not be written: unlike other failures, the run may train on and retry (`checkpoint.on_disk_full`)."""

    def __str__(self) -> str:
        return str(self.strerror)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `path` (or its nearest
    existing parent); None if that cannot be asked."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _sized(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.2f} MiB)"


def no_room(e: OSError, path: Path, nbytes: int, written: int = 0) -> DiskFullError:
    """`e` (one of NO_ROOM) as a DiskFullError naming the file, the bytes missing and the free space,
    so the user knows how much to free."""
    assert e.errno is not None  # only called for errnos in NO_ROOM
    free = free_bytes(path)
    message = (
        f"no room for {path}: {errno.errorcode[e.errno]}, {NO_ROOM[e.errno]}: "
        f"{_sized(nbytes - written)} of its {nbytes} could not be written; "
        + (f"{_sized(free)} free on its file system" if free is not None else "free space unknown")
    )
    return DiskFullError(e.errno, message)


@contextlib.contextmanager
def room_for(path: Path, nbytes: int) -> Iterator[None]:
    """Turn a no-room OSError raised inside into a DiskFullError about writing `nbytes` to `path`."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as e:
        if e.errno in NO_ROOM:
            raise no_room(e, path, nbytes) from e
        raise


def rank_manifest(step_dir: Path, rank: int) -> Path:
    """The file in which a rank lists the files it wrote to `step_dir` and their checksums, for the commit."""
    return Path(step_dir) / f".rank{rank}.manifest.json"


def _open_direct(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT")
    except OSError:  # EINVAL: the file system does not support O_DIRECT
        return os.open(path, flags, 0o644), False


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def write_data(path: Path, image: memoryview, nbytes: int) -> dict:
    """Write image[:nbytes] (page-aligned, nbytes a multiple of 4096) to `path` and fsync it;
    returns its manifest entry. O_DIRECT when possible, else buffered; each chunk's block CRCs are
    computed on a second thread while the next chunk is written (both release the GIL)."""
    view = image[:nbytes]
    delay = float(os.environ.get(DELAY_ENV, 0))
    with room_for(path, nbytes):
        fd, direct = _open_direct(path)
    crcs = []
    try:
        with ThreadPoolExecutor(1) as checksums:
            if delay:
                time.sleep(delay)
            pos = 0
            while pos < nbytes:
                n = min(CHUNK, nbytes - pos)
                try:
                    _pwrite_all(fd, view[pos : pos + n], pos)
                except OSError as e:
                    # the file holds what was written before (a fresh file, written in order)
                    if e.errno in NO_ROOM:
                        raise no_room(e, path, nbytes, min(os.fstat(fd).st_size, nbytes)) from e
                    if not direct or e.errno != errno.EINVAL:
                        raise OSError(
                            e.errno, f"writing {n} bytes at offset {pos} of {path}: {e.strerror}"
                        ) from e
                    os.close(fd)  # O_DIRECT refused this buffer: go on buffered
                    fd, direct = os.open(path, os.O_WRONLY), False
                    continue
                crcs.append(checksums.submit(integrity.block_checksums, view[pos : pos + n]))
                pos += n
                if delay:
                    time.sleep(delay)
            with room_for(path, nbytes):  # a file system that allocates late reports no room here
                os.fsync(fd)
            block_crcs = [crc for f in crcs for crc in f.result()]
    finally:
        os.close(fd)
    return {"bytes": nbytes, "block": integrity.BLOCK, "block_crc32c": block_crcs}


def write_rank(
    step_dir: Path, rank: int, image: memoryview, nbytes: int, extra: dict[str, bytes]
) -> None:
    """One rank's part of a save: its data file, any extra small files, then its manifest."""
    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True, exist_ok=True)
    files = {store.data_file(rank): write_data(step_dir / store.data_file(rank), image, nbytes)}
    for name, data in extra.items():
        _write_small(step_dir / name, data)
        files[name] = integrity.entry(data)
    _write_small(rank_manifest(step_dir, rank), json.dumps(files).encode())


def _write_small(path: Path, data: bytes) -> None:
    with room_for(path, len(data)):
        write_file_atomic(path, data)


def commit(
    step_dir: Path,
    step: int,
    world: int,
    index: dict,
    config_yaml: str,
    keep_last: int,
    suspect: bool = False,
) -> None:
    """Rank 0, once every rank's part is in the partial directory `step_dir`: index.json, .metadata,
    config.yaml, then COMMITTED (with every file's checksums; `suspect` when the run's spike guard
    fired lately), then the rename into place, then retention of older committed checkpoints."""
    from strata.checkpoint import dcp_meta  # imports torch: only rank 0's writer pays for it

    step_dir = Path(step_dir)
    files: dict[str, dict] = {}
    for rank in range(world):
        files.update(json.loads(rank_manifest(step_dir, rank).read_text()))
    small = {
        "index.json": json.dumps(index).encode(),
        "config.yaml": config_yaml.encode(),
        ".metadata": dcp_meta.to_bytes(dcp_meta.build(index, str(step_dir))),
    }
    for name, data in small.items():
        _write_small(step_dir / name, data)
        files[name] = integrity.entry(data)
    record = {
        "step": step,
        "files": files,
        "time": time.time(),
        **({"suspect": True} if suspect else {}),
    }
    _write_small(step_dir / store.MARKER, json.dumps(record).encode())
    final = store.step_dir(step_dir.parent, step)
    store.publish(step_dir, final)
    store.prune(step_dir.parent, keep_last, final)


def serve(image: memoryview, conn: Connection) -> None:
    """The writer loop: ("write", step_dir, rank, nbytes, extra, screen) and ("commit", step_dir,
    step, world, index, config_yaml, keep_last) jobs from the trainer, answered ("ok", kind),
    ("error", kind, message, no_room: bool), or for a write whose image fails its screen
    (`image_check`; None: no checks) ("refused", kind, verdict) with nothing written; None or a
    closed connection stops it."""
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        kind, args = job[0], job[1:]
        try:
            if kind == "write":
                step_dir, rank, nbytes, extra, screen = args
                if screen is not None:
                    verdict = image_check.check(image, screen.spans)
                    if not verdict.passes(screen.limit):
                        conn.send(("refused", kind, verdict))
                        continue
                write_rank(step_dir, rank, image, nbytes, extra)
            else:
                commit(*args)
            conn.send(("ok", kind))
        except Exception as e:  # reported to the trainer, which raises it at its next step
            conn.send(("error", kind, f"{type(e).__name__}: {e}", isinstance(e, DiskFullError)))


def main(argv: list[str]) -> None:
    """Entry of the writer process: IMAGE_FD NBYTES CONN_FD, both descriptors inherited."""
    # Stop signals reach the writer with its trainer (Slurm signals every process of a step;
    # torchrun signals each worker's process group, the writer included) but are for the trainer,
    # which then saves through this writer: the writer must outlive them. It ends when its trainer
    # closes the connection or dies (end of file), and SIGKILL still ends it.
    for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    image_fd, nbytes, conn_fd = (int(a) for a in argv)
    with mmap.mmap(image_fd, nbytes) as image:
        serve(memoryview(image), Connection(conn_fd))


if __name__ == "__main__":
    main(sys.argv[1:])
