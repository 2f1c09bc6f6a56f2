"""ZeRO-Infinity's parameter tier: each flat group's parameter shard (ZeRO-3's master copy on this
rank) lives in host memory or a swap file between uses. It is read ahead of the gather that needs
it, dropped once the gather has read it (clean: no write) — except the `keep_groups` used
last, which are reused at the turns (forward to backward, backward to the update) — and
written back only after the optimizer changed it.

A *resident* budget (`offload.params.resident_mb`, or what the device has free after the first
step: `settle`) keeps whole shards in memory for good, DeepSpeed's `max_reuse_distance` taken to
its end: every use of every step would re-read them, so a shard the device can hold is read once
and never written back (its swap-file region goes stale, and nothing reads it while the shard is
resident).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from strata.offload.swap import Mover, Transfer, Where

if TYPE_CHECKING:
    from strata.parallel.flat_group import FlatGroup


class ParamTier:
    """`where[group.name]`: each group's shard's home (a swap-file region or a host tensor).
    `start()` moves every shard there and frees it on the device."""

    def __init__(
        self,
        groups: list[FlatGroup],
        mover: Mover,
        where: dict[str, Where],
        read_ahead: int,
        keep_groups: int = 0,
        resident_bytes: int | None = 0,
        measure_free: Callable[[], int] | None = None,
    ):
        self.groups, self.mover, self.where, self.read_ahead_groups = (
            groups,
            mover,
            where,
            read_ahead,
        )
        self.keep_groups = keep_groups
        # bytes of shards that stay in memory for good; None: `settle` sizes it after the first step
        self.resident_budget = resident_bytes
        self.measure_free = measure_free  # the device's free bytes now (for `step_done`)
        # never dropped, never written back (their swap copy is stale)
        self.resident: set[str] = set()
        # clean, unused, resident: least recent first
        self._kept: OrderedDict[str, FlatGroup] = OrderedDict()
        self._reads: dict[str, Transfer] = {}
        self._writes: dict[str, Transfer] = {}
        self._pinned: set[str] = set()  # kept resident for the step or a checkpoint

    def start(self) -> None:
        """Move every shard to its home (after the swap files are reserved) and take over the gathers;
        the shards a set resident budget holds stay where they are."""
        if self.resident_budget is not None:
            self._choose_resident(self.resident_budget)
        for g in self.groups:
            g.tier = self
            if g.name not in self.resident:
                self._writes[g.name] = self.mover.write(g.shard, self.where[g.name])
        self.finish_writes(self.groups)

    def step_done(self) -> None:
        """The end of an optimizer step: after the first, an unset budget is sized (`settle`)."""
        if self.resident_budget is None and self.measure_free is not None:
            self.settle(self.measure_free())

    def settle(self, free_bytes: int) -> None:
        """After the first step, with no budget set: keep resident the shards that `free_bytes` (what
        the device had free at that step's peak, less a margin) holds. Those not in memory now are
        read once more, at their next use, and then stay."""
        if self.resident_budget is not None:
            return
        self.resident_budget = max(0, free_bytes)
        self._choose_resident(self.resident_budget)
        for name in self.resident:
            self._kept.pop(name, None)

    def _choose_resident(self, budget: int) -> None:
        """Shards in the update's order while they fit: every shard is used as often as any other
        (twice per micro-batch and once by the update), so any choice saves the same reads per byte."""
        for g in self.groups:
            nbytes = g.shard.numel() * g.shard.element_size()
            if nbytes <= budget:
                self.resident.add(g.name)
                budget -= nbytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the parameter shards kept in memory (not swapped out)."""
        return sum(
            g.shard.numel() * g.shard.element_size() for g in self.groups if g.name in self.resident
        )

    # --- the hooks FlatGroup and ZeroEngine call ------------------------------------------------
    def prefetch(self, group: FlatGroup) -> None:
        """Start reading the shard if it is not in memory or on its way (storage allocated: either)."""
        if _allocated(group):
            return
        _allocate(group)
        self._reads[group.name] = self.mover.read(group.shard, self.where[group.name])

    def ensure(self, group: FlatGroup) -> None:
        """The shard is in memory when this returns (waiting for its read, or reading it now)."""
        self._kept.pop(group.name, None)  # in use: not to be dropped for room meanwhile
        self.prefetch(group)
        read = self._reads.pop(group.name, None)
        if read is not None:
            read.wait()

    def release(self, group: FlatGroup) -> None:
        """The gather is done reading the shard: keep it among the last used, or drop it (unless the
        step or a checkpoint holds it, or it is resident)."""
        if not _allocated(group) or group.name in self._pinned or group.name in self.resident:
            return
        self._kept[group.name] = group
        self._kept.move_to_end(group.name)
        while len(self._kept) > self.keep_groups:
            _drop(self._kept.popitem(last=False)[1])

    def read_ahead(self, groups: list[FlatGroup]) -> None:
        """Start reading each of `groups`' shards that is not in memory (`prefetch`)."""
        for g in groups:
            self.prefetch(g)

    # --- around the optimizer step and checkpoints --------------------------------------------
    def hold(self, group: FlatGroup) -> None:
        """Bring the shard in and keep it until `write_back`."""
        self.ensure(group)
        self._pinned.add(group.name)

    def write_back(self, group: FlatGroup, changed: bool = True) -> None:
        """Let go of a held shard: written home first if `changed`, dropped when that is done."""
        self._pinned.discard(group.name)
        if group.name in self.resident:
            return  # it never leaves memory, so its home copy is never read
        if changed:
            self._writes[group.name] = self.mover.write(group.shard, self.where[group.name])
        else:
            self.release(group)

    def finish_writes(self, groups: list[FlatGroup]) -> None:
        """Wait for the write-backs and drop what they wrote."""
        for g in groups:
            self._evict_after_write(g)

    @contextlib.contextmanager
    def held(self, groups: list[FlatGroup], changed: bool) -> Iterator[None]:
        """Every shard in memory inside the block (a checkpoint save, or a load when `changed`)."""
        for g in groups:
            self.hold(g)
        try:
            yield
        finally:
            for g in groups:
                self.write_back(g, changed)
            self.finish_writes(groups)

    # --- internals -------------------------------------------------------------------------
    def _finish_write(self, group: FlatGroup) -> None:
        write = self._writes.pop(group.name, None)
        if write is not None:
            write.wait()

    def _evict_after_write(self, group: FlatGroup) -> None:
        if group.name in self._writes:
            self._finish_write(group)
            self.release(group)  # clean again


def _allocated(group: FlatGroup) -> bool:
    return group.shard.untyped_storage().nbytes() > 0


def _allocate(group: FlatGroup) -> None:
    storage = group.shard.untyped_storage()
    storage.resize_(group.shard.numel() * group.shard.element_size())


def _drop(group: FlatGroup) -> None:
    # resize, never rebind: the optimizer's pieces are views of this storage and must stay valid
    group.shard.untyped_storage().resize_(0)
