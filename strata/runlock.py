"""One writer per run: an exclusive lock on a run directory and on a checkpoint directory, held for as
long as the job that writes them lives.

The lock is `flock` on a file `.strata.lock` inside the directory, so the kernel drops it when the
holding process dies (a crash or SIGKILL never leaves a stale lock behind that blocks the next
run); the file keeps the holder's host, pid, start time and command, which a refused writer names.
One process of a job holds it (rank 0 of the training job, or the command that writes), not each
rank. The file stays after the run, holding the last holder's record; it is never a checkpoint.

Across machines: on NFS, Linux clients carry `flock` to the server as a byte-range lock (NFSv4, or
NLM for v3), so writers on different nodes exclude each other. Lustre does so only when mounted
with `-o flock`; with `localflock` the lock excludes writers on the same node only, and with
`noflock` it cannot be taken at all, in which case the writer goes on with a warning rather than
refusing every run on that file system.

The lock file is opened without following a symbolic link (`O_NOFOLLOW`): a `.strata.lock` that is
a link (to a user's file, which taking the lock would truncate and overwrite) or a directory is
refused, as is any other error of the file system (a directory under /proc, a read-only or full
disk, an immutable file), each as one message naming the path, before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from strata.errors import StrataError

LOCK_NAME = ".strata.lock"
# flock not offered by the file system (Lustre's noflock, some FUSE mounts): warn and go on
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


# directory -> [holders in this process, the locked descriptor]
_HELD: dict[Path, list[int]] = {}


class RunLocked(StrataError):
    """Another live process holds the lock of a directory this command would write."""


def _not_a_lock_file(path: Path) -> str | None:
    """Why `path` cannot be a lock file (a symbolic link or a directory), or None."""
    if path.is_symlink():
        return "a symbolic link"
    if path.is_dir():
        return "a directory"
    return None


def unusable(path: Path, what: str, reason: str, misplaced: bool = False) -> StrataError:
    """The refusal of a lock file the command cannot create, open or write, naming the path and the
    fix (`misplaced`: something else is where the lock file goes)."""
    fix = (
        f"move it away if it is not a lock Strata made, or choose another {what}"
        if misplaced
        else f"choose a {what} on a file system this command can write"
    )
    return StrataError(
        f"{path}: the lock file of the {what} cannot be used ({reason}); nothing was written: {fix}"
    )


def describe_holder(record: dict) -> str:
    """`host`, `pid`, start time and command of a lock's holder, as one phrase."""
    if not record:
        return "another process (it has not recorded itself yet)"
    started = record.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    return (
        f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {when} "
        f"({record.get('command', '?')})"
    )


def holder(directory: Path) -> dict:
    """The record the lock file of `directory` holds ({} when there is none or it is unreadable)."""
    try:
        record = json.loads((Path(directory) / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def in_use(directory: Path, what: str) -> RunLocked:
    """The refusal of a second writer of `directory`, naming the holder."""
    return RunLocked(
        f"{what} {directory} is in use by {describe_holder(holder(directory))}: two writers would "
        "mix their logs and replace each other's checkpoints. Wait for it to end (or stop it), or "
        "choose another directory (log.name, checkpoint.dir)"
    )


def _reason(e: OSError) -> str:
    """An OSError as `ENAME: its text`, with the words a user needs where the text misleads."""
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__
    if e.errno == errno.ELOOP:
        return f"{name}: it is a symbolic link"
    return f"{name}: {e.strerror or e}"


class DirectoryLock:
    """The exclusive lock of one directory, taken with `acquire` and held until `release` or the
    process's exit."""

    def __init__(self, directory: Path, what: str):
        self.directory, self.what = Path(directory), what
        self.fd: int | None = None
        self.warning = ""  # set when the file system offers no lock

    def acquire(self) -> None:
        """Take the lock without waiting; raise RunLocked naming the holder if it is taken. A process
        that already holds it (a test building several trainers of one run) shares its hold."""
        if self.directory in _HELD:
            _HELD[self.directory][0] += 1
            self.fd = _HELD[self.directory][1]
            return
        path = self.directory / LOCK_NAME
        kind = _not_a_lock_file(path)
        if kind is not None:
            raise unusable(path, self.what, f"it is {kind}", misplaced=True)
        existed = path.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise unusable(path, self.what, _reason(e)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise in_use(self.directory, self.what) from None
            if e.errno in UNSUPPORTED:
                self.warning = (
                    f"warning: {path}: this file system offers no locks ({os.strerror(e.errno)}); "
                    "nothing stops a "
                    "second job from writing the same run (on Lustre, mount with -o flock)"
                )
                return
            raise StrataError(
                f"{path}: cannot be locked ({e.strerror}); check the directory's permissions"
            ) from e
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "command": " ".join(["strata", *sys.argv[1:]])[:300],
        }
        # in place, not by rename: the lock belongs to this inode
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError as e:
            os.close(fd)
            if not existed:  # an empty file made just now (a full disk still takes an inode)
                with contextlib.suppress(OSError):
                    path.unlink()
            raise unusable(path, self.what, _reason(e)) from e
        self.fd = fd
        _HELD[self.directory] = [1, fd]

    def release(self) -> None:
        """Let the lock go (closing the descriptor drops it) once no other holder in this process
        shares it."""
        if self.fd is None:
            return
        held = _HELD.get(self.directory)
        if held is not None:
            held[0] -= 1
            if held[0] > 0:
                self.fd = None
                return
            del _HELD[self.directory]
        os.close(self.fd)
        self.fd = None


class RunLocks:
    """The locks a writer holds: each distinct directory once (a checkpoint directory inside the run
    directory is locked too, since another run's checkpoint.dir may point at it)."""

    def __init__(self, directories: list[tuple[Path, str]]):
        seen: set[Path] = set()
        self.locks: list[DirectoryLock] = []
        for directory, what in directories:
            key = Path(os.path.abspath(directory))
            if key not in seen:
                seen.add(key)
                self.locks.append(DirectoryLock(key, what))

    @property
    def warnings(self) -> list[str]:
        """One line per directory whose file system offers no locks."""
        return [lock.warning for lock in self.locks if lock.warning]

    def acquire(self) -> RunLocks:
        """Take every lock, or none (RunLocked names the first one held elsewhere)."""
        try:
            for lock in self.locks:
                lock.acquire()
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        """Let every lock go."""
        for lock in self.locks:
            lock.release()


@contextlib.contextmanager
def locked(directories: list[tuple[Path, str]]) -> Iterator[RunLocks]:
    """Hold the locks of `directories` ([(path, what it is)]) inside the block."""
    locks = RunLocks(directories).acquire()
    try:
        yield locks
    finally:
        locks.release()


def _cannot_create(path: Path, what: str) -> StrataError | None:
    """Why the lock file `path`, which does not exist yet, could not be created, as far as can be
    told without creating anything: the nearest existing folder above it is a file, is on a kernel
    interface (/proc, /sys: a file system of no blocks) or a read-only or full file system."""
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return unusable(path, what, f"{above} is not a directory")
    try:
        fs = os.statvfs(above)
    except OSError as e:
        return unusable(path, what, _reason(e))
    if fs.f_blocks == 0:
        return unusable(path, what, f"{above} is a kernel interface, not a file system for files")
    if fs.f_flag & os.ST_RDONLY:
        return unusable(path, what, f"{above} is on a read-only file system")
    if (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) == 0:
        return unusable(path, what, f"the file system of {above} is full")
    return None


def check_free(directories: list[tuple[Path, str]]) -> None:
    """Raise RunLocked if any existing directory's lock is held now, or a StrataError if its lock
    file could not be taken (a launcher's early look, before it starts workers; the workers take the
    lock themselves). Creates and writes nothing."""
    for directory, what in directories:
        path = Path(directory) / LOCK_NAME
        kind = _not_a_lock_file(path)
        if kind is not None:
            raise unusable(path, what, f"it is {kind}", misplaced=True)
        if not path.is_file():
            refusal = _cannot_create(path, what)
            if refusal is not None:
                raise refusal
            continue
        try:
            # read-write, as the workers will open it (an immutable file or a read-only mount
            # refuses here); without O_CREAT or O_TRUNC nothing changes
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise unusable(path, what, _reason(e)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise in_use(Path(directory), what) from None
        finally:
            os.close(fd)
