"""Crash-safe writes: build a directory or file under a temporary name, fsync it, then rename it
into place, so a reader sees either the old version or the complete new one, never a partial one."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory entry table."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write bytes to `path` via temp file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success fsync its files and rename it to `final`.

    An existing `final` is replaced only after the new one is complete. On an exception the
    temporary directory is removed and `final` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                fsync_path(child)
        fsync_path(tmp)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
