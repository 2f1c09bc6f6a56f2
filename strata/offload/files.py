"""Swap files: one preallocated file per rank and kind (params, optim, activations) under
`offload.nvme_path`, handed out in 4 KiB-aligned regions at set-up — so a full, read-only or
forbidden disk fails at start-up with the path, the bytes and the errno, never mid-step.
"""

from __future__ import annotations

import errno as errno_names
import os
import shutil
from pathlib import Path

from strata.offload.io_engine import SwapIOError, aligned, check_swap_dir


class SwapFile:
    """A scratch file of a fixed planned size, carved into aligned regions by `region`. Scratch:
    it is read back only by this process, so it is never fsynced, and removed at `close`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = 0  # bytes handed out
        self.allocated = 0  # bytes preallocated on disk

    def region(self, nbytes: int) -> int:
        """The offset of a new aligned region of `nbytes` (set-up time)."""
        offset = self.size
        self.size += aligned(nbytes)
        return offset

    def preallocate(self, key: str) -> None:
        """Reserve the planned size on disk now (posix_fallocate), so ENOSPC/EFBIG surface here;
        `key` is the config key that chose this file, for the message."""
        if self.size <= self.allocated:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise SwapIOError(_setup_message(key, self.path, self.size, e)) from e
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            raise SwapIOError(_setup_message(key, self.path, self.size, e)) from e
        finally:
            os.close(fd)
        self.allocated = self.size


def _setup_message(key: str, path: Path, nbytes: int, err: OSError) -> str:
    name = errno_names.errorcode.get(err.errno, "?") if err.errno else "?"
    try:
        st = os.statvfs(path.parent)
        free = f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free there"
    except OSError:
        free = "free space unknown"
    return (
        f"{key}: cannot reserve {nbytes / 2**20:.1f} MiB for swap file {path} "
        f"({err.strerror or err}, errno {err.errno} {name}; {free}); point offload.nvme_path at a "
        "writable local SSD with room, or offload less"
    )


class SwapDir:
    """This process's directory of swap files, `<nvme_path>/strata-rank<r>-<pid>/<kind>.swp`,
    checked (writable, room, one O_DIRECT probe) before any file is planned, removed at close."""

    def __init__(self, nvme_path: str | Path, rank: int):
        self.path = Path(nvme_path) / f"strata-rank{rank}-{os.getpid()}"
        check_swap_dir(self.path, 0)
        self.files: dict[str, SwapFile] = {}

    def file(self, kind: str) -> SwapFile:
        """The swap file of `kind` (params, optim, ...) in this directory, made at its first use."""
        if kind not in self.files:
            self.files[kind] = SwapFile(self.path / f"{kind}.swp")
        return self.files[kind]

    def preallocate(self, keys: dict[str, str]) -> None:
        """Reserve every planned file (`keys`: kind → the config key that asked for it), after
        checking the total against the free space so the message names the total."""
        needed = sum(f.size - f.allocated for f in self.files.values())
        check_swap_dir(self.path, needed)
        for kind, f in self.files.items():
            f.preallocate(keys.get(kind, "offload.nvme_path"))

    def close(self) -> None:
        """Remove the directory and every swap file in it."""
        shutil.rmtree(self.path, ignore_errors=True)
