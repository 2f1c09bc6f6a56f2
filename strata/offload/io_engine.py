"""The file I/O engine for swapping tensors to NVMe: reads and writes of page-aligned buffers,
split into requests that a small thread pool issues with O_DIRECT `pread`/`pwrite` (both release
the GIL), behind one interface — `read`/`write` return a handle, `wait` finishes it — whose errors
name the path, offset, byte count and errno instead of failing an assertion.

A thread pool rather than DeepSpeed's libaio op: it needs no system package or JIT build, and the
same interface can front the op where it builds (docs/design/offload.md).
"""

from __future__ import annotations

import errno as errno_names
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from strata.errors import StrataError

ALIGN = 4096  # O_DIRECT: address, offset and length all multiples of the logical block size


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the O_DIRECT alignment."""
    return -(-nbytes // ALIGN) * ALIGN


class SwapIOError(StrataError):
    """A swap file read or write failed; the message names the file, offset, size and errno."""


def _describe(op: str, path: Path, offset: int, nbytes: int, err: OSError) -> str:
    name = errno_names.errorcode.get(err.errno, "?") if err.errno else "?"
    return (
        f"{op} of {nbytes} bytes at offset {offset} of {path} failed: {err.strerror or err} "
        f"(errno {err.errno} {name})"
    )


class Handle:
    """An I/O request in flight: `wait()` returns when all its pieces are done, or raises the first failure."""

    def __init__(self, futures: list[Future]):
        self._futures = futures

    def done(self) -> bool:
        """Whether every piece of the request has finished (a failure counts as finished)."""
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every piece is done; raises the first failure."""
        for f in self._futures:
            f.result()


class IOEngine:
    """Aligned reads and writes of whole files or file ranges, `threads` requests at a time, each
    request at most `chunk_bytes` (defaults: 4 threads of 4 MiB, the kernel's largest request
    here, which matched DeepSpeed's libaio op on this disk: docs/design/offload.md §2.1).
    `direct=False`, or a file system refusing O_DIRECT, goes through the page cache instead
    (recorded in `self.buffered_paths`), dropping each chunk from it after use so swapped data
    does not silently fill host memory."""

    def __init__(self, threads: int = 4, chunk_bytes: int = 4 << 20, direct: bool = True):
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of {ALIGN}")
        self.chunk_bytes, self.direct = chunk_bytes, direct and hasattr(os, "O_DIRECT")
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="strata-io")
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.buffered_paths: set[Path] = set()
        self.bytes_read = self.bytes_written = 0

    # --- the interface -----------------------------------------------------------------------
    def write(self, path: Path, buffer: torch.Tensor, offset: int = 0) -> Handle:
        """Start writing `buffer` (contiguous, page-aligned, a multiple of 4096 bytes) at `offset`."""
        return self._submit("write", Path(path), buffer, offset)

    def read(self, path: Path, buffer: torch.Tensor, offset: int = 0) -> Handle:
        """Start filling `buffer` (as for `write`) from `offset` of the file."""
        return self._submit("read", Path(path), buffer, offset)

    def close(self) -> None:
        """Finish the queued requests, stop the threads and close every file this engine opened."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # --- internals -------------------------------------------------------------------------
    def _submit(self, op: str, path: Path, buffer: torch.Tensor, offset: int) -> Handle:
        view = _aligned_bytes(buffer, offset)
        fd = self._fd(path)
        futures = [
            self._pool.submit(
                self._run, op, fd, path, view[pos : pos + self.chunk_bytes], offset + pos
            )
            for pos in range(0, len(view), self.chunk_bytes)
        ]
        return Handle(futures)

    def _run(self, op: str, fd: int, path: Path, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(view):
                if op == "write":
                    n = os.pwrite(fd, view[done:], offset + done)
                else:
                    n = os.preadv(fd, [view[done:]], offset + done)
                    if n == 0:
                        raise OSError(errno_names.ENODATA, "end of file before the requested bytes")
                done += n
            if path in self.buffered_paths:
                if op == "write":
                    os.fdatasync(fd)  # DONTNEED drops only clean pages
                os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise SwapIOError(_describe(op, path, offset + done, len(view) - done, e)) from e
        with self._lock:
            if op == "write":
                self.bytes_written += len(view)
            else:
                self.bytes_read += len(view)

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                return fd
            flags = os.O_RDWR | os.O_CREAT
            try:
                fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
            except OSError as e:
                if not (self.direct and e.errno == errno_names.EINVAL):
                    raise SwapIOError(_describe("open", path, 0, 0, e)) from e
                # e.g. tmpfs: no O_DIRECT, go through the page cache
                fd = os.open(path, flags, 0o600)
                self.buffered_paths.add(path)
            self._fds[path] = fd
            return fd


def _aligned_bytes(buffer: torch.Tensor, offset: int) -> memoryview:
    """The buffer's bytes, checked for what O_DIRECT needs."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("swap buffers must be contiguous host tensors")
    nbytes = buffer.numel() * buffer.element_size()
    if buffer.data_ptr() % ALIGN or nbytes % ALIGN or offset % ALIGN:
        raise ValueError(
            f"swap I/O needs {ALIGN}-byte alignment of the buffer address "
            f"({buffer.data_ptr() % ALIGN} off), its size ({nbytes}) and the file offset "
            f"({offset}); take buffers from the offload buffer pool"
        )
    return buffer.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def check_swap_dir(path: Path, needed_bytes: int) -> None:
    """At start-up, not mid-step: `path` must be a writable directory with room for `needed_bytes`
    (probed with a real aligned write), else a SwapIOError saying what is wrong and what to set."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SwapIOError(
            f"offload.nvme_path {path}: cannot create it ({e.strerror}, errno {e.errno}); point "
            "offload.nvme_path at a writable directory on a local SSD"
        ) from e
    if not path.is_dir():
        raise SwapIOError(
            f"offload.nvme_path {path} is not a directory; point it at a directory on a local SSD"
        )
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if st.f_flag & os.ST_RDONLY:
        raise SwapIOError(
            f"offload.nvme_path {path} is on a read-only file system; point it at a writable SSD"
        )
    if free < needed_bytes:
        raise SwapIOError(
            f"offload.nvme_path {path} has {free / 2**30:.2f} GiB free, the swapped state needs "
            f"{needed_bytes / 2**30:.2f} GiB; free space there or choose a larger disk"
        )
    probe = path / f".strata-probe-{os.getpid()}"
    engine = IOEngine(threads=1)
    buf = torch.empty(ALIGN + ALIGN, dtype=torch.uint8)
    page = buf[(-buf.data_ptr()) % ALIGN :][:ALIGN]  # a page-aligned 4 KiB view
    try:
        engine.write(probe, page).wait()
        engine.read(probe, page).wait()
    finally:
        engine.close()
        probe.unlink(missing_ok=True)
