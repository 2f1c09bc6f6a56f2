"""Moving tensors between their device and a slower tier: a region of a swap file (through the
pool's slabs, a few chunks in flight) or a host tensor. Transfers run on a worker thread per
stream and return a `Transfer` to wait on, so reads are issued ahead of use and writes behind it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from strata.offload.files import SwapFile
from strata.offload.io_engine import IOEngine, aligned
from strata.offload.pool import HostPool, Slab


@dataclass(frozen=True)
class FileRegion:
    """`nbytes` at `offset` (aligned) of a swap file."""

    file: SwapFile
    offset: int
    nbytes: int


Where = FileRegion | torch.Tensor  # a swap-file region, or a host tensor of the same size


class Transfer:
    """A transfer in flight. `wait()` returns when it is done (raising its error) and counts the
    time the caller was blocked, the measure of how well I/O overlaps compute."""

    def __init__(self, future: Future, mover: Mover):
        self._future, self._mover = future, mover

    def done(self) -> bool:
        """Whether the transfer has finished (a failure counts as finished)."""
        return self._future.done()

    def wait(self) -> None:
        """Block until the transfer is done, raising its error; the time blocked counts in the
        mover's `stalled_s`."""
        if not self._future.done():
            start = time.perf_counter()
            try:
                self._future.result()
            finally:
                self._mover.stalled_s += time.perf_counter() - start
        self._future.result()


class Mover:
    """Transfers for one pool stream (`params`, `optim`, `activations`), in submission order.
    Each file transfer streams through at most `depth` slabs of the stream at once; a host-tensor
    transfer is one copy. CUDA tensors are copied on a side stream of their own, after the work
    queued so far on the caller's stream (so a write sees the values the caller computed)."""

    def __init__(
        self,
        pool: HostPool,
        engine: IOEngine | None,
        stream: str,
        depth: int = 4,
        timeout_s: float = 120.0,
    ):
        self.pool, self.engine, self.stream = pool, engine, stream
        self.depth, self.timeout_s = max(1, depth), timeout_s
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"strata-{stream}")
        self._side: torch.cuda.Stream | None = None
        self.stalled_s = 0.0

    def write(self, src: torch.Tensor, where: Where) -> Transfer:
        """Start copying the contiguous tensor `src` to `where`."""
        return self._submit(self._write, src, where)

    def read(self, dst: torch.Tensor, where: Where) -> Transfer:
        """Start filling the contiguous tensor `dst` from `where`."""
        return self._submit(self._read, dst, where)

    def close(self) -> None:
        """Finish the queued transfers and stop the mover's thread."""
        self._worker.shutdown(wait=True)

    # --- internals -------------------------------------------------------------------------
    def _submit(self, fn, tensor: torch.Tensor, where: Where) -> Transfer:
        if not tensor.is_contiguous():
            raise ValueError("offload transfers take contiguous tensors")
        ready = None
        if tensor.is_cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(tensor.device)
            ready = torch.cuda.current_stream(tensor.device).record_event()
        return Transfer(self._worker.submit(fn, tensor, where, ready), self)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """dst ← src, finished when this returns (on the side stream for CUDA)."""
        if ready is None:
            dst.copy_(src)
            return
        side = self._side
        assert side is not None, "made by _submit with the event"
        with torch.cuda.stream(side):
            side.wait_event(ready)
            dst.copy_(src, non_blocking=True)
        side.synchronize()

    def _file_engine(self) -> IOEngine:
        if self.engine is None:
            raise ValueError(
                f"the {self.stream} mover has no I/O engine: it moves host tensors only"
            )
        return self.engine

    def _write(self, src: torch.Tensor, where: Where, ready) -> None:
        data = _bytes(src)
        if isinstance(where, torch.Tensor):
            self._copy(_bytes(where), data, ready)
            return
        _check_fits(data, where)
        engine = self._file_engine()
        with _InFlight(self) as flight:
            for pos, n, slab in flight.chunks(data.numel()):
                self._copy(slab.tensor[:n], data[pos : pos + n], ready)
                flight.add(
                    engine.write(where.file.path, slab.tensor[: aligned(n)], where.offset + pos),
                    slab,
                )

    def _read(self, dst: torch.Tensor, where: Where, ready) -> None:
        data = _bytes(dst)
        if isinstance(where, torch.Tensor):
            self._copy(data, _bytes(where), ready)
            return
        _check_fits(data, where)
        engine = self._file_engine()
        with _InFlight(self) as flight:
            for pos, n, slab in flight.chunks(data.numel()):
                handle = engine.read(where.file.path, slab.tensor[: aligned(n)], where.offset + pos)
                flight.add(
                    handle,
                    slab,
                    lambda s=slab, p=pos, n=n: self._copy(data[p : p + n], s.tensor[:n], ready),
                )


class _InFlight:
    """The chunks of one file transfer in flight, each holding a slab until its I/O (and the copy
    out of it, for reads) is done; at most `depth` at once, fewer when the budget is short."""

    def __init__(self, mover: Mover):
        self.mover = mover
        self.queue: deque[tuple] = deque()

    def __enter__(self) -> _InFlight:
        return self

    def chunks(self, nbytes: int) -> Iterator[tuple[int, int, Slab]]:
        """(offset, length, slab to carry it) for each slab-sized chunk of a transfer of `nbytes`."""
        step = self.mover.pool.slab_bytes
        for pos in range(0, nbytes, step):
            yield pos, min(step, nbytes - pos), self.borrow()

    def borrow(self) -> Slab:
        """A slab for the next chunk, finishing the oldest chunks first while `depth` are in flight
        or the pool has none free."""
        pool, stream = self.mover.pool, self.mover.stream
        while len(self.queue) >= self.mover.depth:
            self._finish_oldest()
        slab = pool.try_borrow(stream) if self.queue else None
        while slab is None and self.queue:  # finish our own chunks before waiting on anyone else's
            self._finish_oldest()
            slab = pool.try_borrow(stream)
        return slab or pool.borrow(stream, self.mover.timeout_s)

    def add(self, handle, slab: Slab, then=None) -> None:
        """Track a chunk's I/O `handle` and its slab; `then` runs once the I/O is done, before the
        slab goes back."""
        self.queue.append((handle, slab, then))

    def _finish_oldest(self) -> None:
        handle, slab, then = self.queue.popleft()
        try:
            handle.wait()
            if then is not None:
                then()
        finally:
            self.mover.pool.give_back(slab)

    def __exit__(self, *exc) -> None:
        first_error = None
        while self.queue:  # every slab goes back, also after an error
            try:
                self._finish_oldest()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest are back
                first_error = first_error or e
        if first_error is not None and exc[0] is None:
            raise first_error


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _check_fits(data: torch.Tensor, where: FileRegion) -> None:
    if data.numel() > where.nbytes:
        raise ValueError(
            f"{data.numel()} bytes do not fit the {where.nbytes}-byte region at {where.offset} of "
            f"{where.file.path}"
        )
