"""Host memory for offloading, one arena per rank allocated once (MemAscend's answer to
ZeRO-Infinity's host-memory blow-ups): a *resident* region, bump-allocated at set-up for state
that lives on the CPU, and a *staging* region of equal slabs, capped by `offload.host_buffer_mb`,
through which every transfer streams in slab-sized chunks — so no request needs contiguous room,
nothing fragments, and no buffer has to be as large as the largest tensor.

Each stream (params, optim, activations) is guaranteed a minimum number of slabs and shares the
rest, so a burst on one cannot starve another (no deadlock). A borrow beyond the budget waits; if
none comes back in time it raises an error naming who holds the slabs — the budget is never
exceeded, because nothing allocates outside the arena. With CUDA the arena is pinned once with
cudaHostRegister (never `pin_memory()`, which rounds up to a power of two and caches forever).
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass

import torch

from strata.errors import ConfigError, StrataError
from strata.offload.io_engine import ALIGN, aligned
from strata.parallel.runtime import pin_host, unpin_host


class OffloadBudgetError(StrataError):
    """The staging budget stayed exhausted; the message says who holds it and what to change."""


@dataclass
class Slab:
    """One staging slab borrowed from the pool: its index, the stream holding it, and its bytes."""

    index: int
    stream: str
    tensor: torch.Tensor  # uint8, page-aligned, slab_bytes long

    @property
    def view(self) -> memoryview:
        """The slab's bytes as a memoryview, for file reads and writes."""
        return self.tensor.numpy().data.cast("B")


class HostPool:
    """See the module docstring. `min_slabs`: {stream: slabs it is always able to get}."""

    def __init__(
        self,
        staging_bytes: int,
        slab_bytes: int = 4 << 20,
        resident_bytes: int = 0,
        min_slabs: dict[str, int] | None = None,
    ):
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ConfigError(
                [f"offload slab size {slab_bytes} must be a positive multiple of {ALIGN} bytes"]
            )
        self.slab_bytes, self.n_slabs = slab_bytes, staging_bytes // slab_bytes
        self.min_slabs = dict(min_slabs or {})
        reserved = sum(self.min_slabs.values())
        if self.n_slabs < max(reserved, 1):
            need = max(reserved, 1) * slab_bytes / 2**20
            raise ConfigError(
                [
                    f"offload.host_buffer_mb={staging_bytes / 2**20:g} holds {self.n_slabs} slabs "
                    f"of {slab_bytes / 2**20:g} MiB, fewer than the {max(reserved, 1)} the streams "
                    f"need at least ({self.min_slabs}); set it to at least {need:g}"
                ]
            )
        self.resident_bytes = aligned(resident_bytes)
        total = self.resident_bytes + self.n_slabs * slab_bytes
        # page-aligned; lives as long as the pool (views keep it)
        self._arena = mmap.mmap(-1, total)
        self.arena = torch.frombuffer(self._arena, dtype=torch.uint8)
        self.pinned = pin_host(self.arena)
        self._resident_used = 0
        self._free = list(range(self.n_slabs))
        self._held: dict[str, int] = {}
        self._cond = threading.Condition()
        self.peak_slabs = 0
        self.waits, self.wait_s = 0, 0.0

    # --- resident region (set-up time) ---------------------------------------------------------
    def resident(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A page-aligned tensor of `nbytes` (rounded up to 4 KiB) from the resident region."""
        size = aligned(nbytes)
        if self._resident_used + size > self.resident_bytes:
            raise OffloadBudgetError(
                f"the offload pool's resident region ({self.resident_bytes} bytes) is planned "
                f"too small: {self._resident_used} used, {size} more asked for (a bug in "
                "the offload plan; please report it)"
            )
        out = self.arena[self._resident_used : self._resident_used + nbytes]
        self._resident_used += size
        return out.view(dtype)

    # --- staging slabs --------------------------------------------------------------------------
    def borrow(self, stream: str, timeout_s: float = 60.0) -> Slab:
        """A free slab for `stream`, waiting while the budget is used up (at most `timeout_s`)."""
        with self._cond:
            start = time.perf_counter()
            waited = False
            while not self._may_take(stream):
                waited = True
                left = timeout_s - (time.perf_counter() - start)
                if left <= 0 or not self._cond.wait(left):
                    if not self._may_take(stream):
                        raise OffloadBudgetError(self._exhausted(stream, timeout_s))
            if waited:
                self.waits += 1
                self.wait_s += time.perf_counter() - start
            return self._take(stream)

    def _take(self, stream: str) -> Slab:
        index = self._free.pop()
        self._held[stream] = self._held.get(stream, 0) + 1
        self.peak_slabs = max(self.peak_slabs, self.n_slabs - len(self._free))
        base = self.resident_bytes + index * self.slab_bytes
        return Slab(index, stream, self.arena[base : base + self.slab_bytes])

    def try_borrow(self, stream: str) -> Slab | None:
        """A free slab for `stream` if one may be taken now, else None (never waits): a transfer
        holding slabs of its own finishes one of those instead of waiting on the budget."""
        with self._cond:
            if not self._may_take(stream):
                return None
            return self._take(stream)

    def give_back(self, slab: Slab) -> None:
        """Return a borrowed slab to the pool and wake any borrower waiting for one."""
        with self._cond:
            self._free.append(slab.index)
            self._held[slab.stream] -= 1
            self._cond.notify_all()

    def _may_take(self, stream: str) -> bool:
        if not self._free:
            return False
        if self._held.get(stream, 0) < self.min_slabs.get(stream, 0):
            return True  # within the stream's guaranteed share
        shared = self.n_slabs - sum(self.min_slabs.values())
        borrowed_beyond_minimum = sum(
            max(0, n - self.min_slabs.get(s, 0)) for s, n in self._held.items()
        )
        return borrowed_beyond_minimum < shared

    def _exhausted(self, stream: str, timeout_s: float) -> str:
        held = " ".join(f"{s}:{n}" for s, n in sorted(self._held.items()) if n)
        return (
            f"offload.host_buffer_mb={self.n_slabs * self.slab_bytes / 2**20:g} ({self.n_slabs} "
            f"slabs of {self.slab_bytes / 2**20:g} MiB) stayed exhausted for {timeout_s:g} s while "
            f"{stream!r} waited for a slab; held by {held or 'nobody'}. Raise "
            "offload.host_buffer_mb, or read fewer blocks ahead"
        )

    @property
    def peak_staging_bytes(self) -> int:
        """The most staging memory borrowed at once so far, in bytes."""
        return self.peak_slabs * self.slab_bytes

    def close(self) -> None:
        """Unlock the pool's page-locked memory; the memory itself is freed with the pool."""
        if self.pinned:
            unpin_host(self.arena)
            self.pinned = False
