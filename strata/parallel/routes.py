"""Moving a flat buffer's state between partition levels (`parallel.topology` CHAIN levels): this
rank's reduce-scatters and all-gathers over digit groups, fastest level first (or one collective
over the whole span when not hierarchical). The ZeRO engine's only communication pattern.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.parallel import comm
from strata.parallel.topology import CHAIN, RankGroups


@dataclass(frozen=True)
class Hop:
    """One step of a reduction chain (`parallel.overlap`): a collective over the digit group
    `key` = (inner, outer, op) that `start(buffer)` begins, returning its output buffer and the work
    in flight; or, with `key` None, a local operation whose work is None."""

    key: tuple[str, str, str] | None
    start: Callable[[torch.Tensor], tuple[torch.Tensor, comm.AsyncWork | None]]


class Routes:
    """This rank's collectives between partition levels of a flat buffer of `numel` elements
    (a multiple of every level's chunk count). With `dedicated`, over process groups of their own
    (`RankGroups.dedicated_digit_group`), which nothing else queues work on: for reductions run
    beside the main thread's collectives. Those are made by `steps` on first use, so every rank
    must ask for the same steps in the same order before any runs."""

    def __init__(
        self, topo: RankGroups, hierarchical: bool, dim: str = "dp", dedicated: bool = False
    ):
        self.topo, self.hierarchical, self.dim, self.dedicated = topo, hierarchical, dim, dedicated
        self._chunks: dict[tuple[int, str], tuple[int, int]] = {}
        self._groups: dict[tuple[str, str, str], tuple[object, list[int]]] = {}

    def chunk(self, level: str, rank: int | None = None) -> tuple[int, int]:
        rank = self.topo.rank if rank is None else rank
        if (rank, level) not in self._chunks:
            self._chunks[(rank, level)] = self.topo.layout.nested_chunk(rank, level)
        return self._chunks[(rank, level)]

    def span(self, level: str, numel: int, rank: int | None = None) -> tuple[int, int]:
        """(start, size) of `rank`'s chunk at `level` in a flat buffer of `numel` elements."""
        index, count = self.chunk(level, rank)
        return index * (numel // count), numel // count

    def count(self, level: str) -> int:
        return self.chunk(level)[1]

    def steps(
        self, fine: str, coarse: str, op: str = ""
    ) -> list[tuple[str, str, object, list[int]]]:
        """The collectives from partitioning at `fine` to `coarse`: (inner, outer, group, members).
        With `dedicated` routes, each `op` (rs, ag, ar) over a pair of levels has a group of its own."""
        out = []
        for inner, outer in self._pairs(fine, coarse):
            key = (inner, outer, op if self.dedicated else "")
            if key not in self._groups:
                group, members = self.topo.digit_group(inner, outer)
                if self.dedicated and group is not None:
                    group = self.topo.dedicated_digit_group(inner, outer)
                self._groups[key] = group, members
            group, members = self._groups[key]
            if group is not None:
                out.append((inner, outer, group, members))
        return out

    def reduce_scatter(self, buf: torch.Tensor, fine: str, coarse: str, numel: int) -> torch.Tensor:
        """`buf` holds this rank's `fine` chunk of a sum each rank contributes to; returns its
        `coarse` chunk of the sum over the ranks partitioning between the two levels."""
        return _run(self.reduce_scatter_hops(fine, coarse, numel), buf)

    def levels_apart(self, fine: str, coarse: str) -> int:
        """How many collectives `steps(fine, coarse)` takes (without making dedicated groups)."""
        return sum(
            self.topo.digit_group(inner, outer)[0] is not None
            for inner, outer in self._pairs(fine, coarse)
        )

    def _pairs(self, fine: str, coarse: str) -> list[tuple[str, str]]:
        return level_pairs(fine, coarse, self.hierarchical)

    def reduce_scatter_hops(self, fine: str, coarse: str, numel: int) -> list[Hop]:
        """`reduce_scatter` as hops to start one by one (each on the previous one's output)."""
        hops = []
        for inner, outer, group, members in self.steps(fine, coarse, "rs"):
            base, _ = self.span(inner, numel)
            size = numel // self.count(outer)
            starts = [self.span(outer, numel, m)[0] - base for m in members]

            def start(buf: torch.Tensor, group=group, size=size, starts=starts):
                out = buf.new_empty(size)
                views = [buf[s : s + size] for s in starts]
                return out, comm.reduce_scatter_views_async(out, views, group, self.dim)

            hops.append(Hop((inner, outer, "rs"), start))
        return hops

    def all_reduce_hops(self, fine: str, coarse: str, numel: int) -> list[Hop]:
        """Sum a `fine` chunk (in place) over the ranks holding copies of it up to `coarse`. Over
        one level, one all-reduce; over several, reduce-scatters up the levels and all-gathers
        back down: each slower link then carries only the faster level's share of the chunk
        (a ring all-reduce across nodes would carry 2(n-1)/n of it; an all-reduce per level the
        whole of it, once per rank of the node)."""
        if self.levels_apart(fine, coarse) < 2:

            def all_reduce(buf: torch.Tensor, group: object) -> tuple[torch.Tensor, comm.AsyncWork]:
                return buf, comm.all_reduce_async(buf, group, self.dim)

            return [
                Hop((inner, outer, "ar"), functools.partial(all_reduce, group=group))
                for inner, outer, group, _ in self.steps(fine, coarse, "ar")
            ]
        steps = self.steps(fine, coarse, "ag")
        whole: list[torch.Tensor] = []  # the chunk being summed, which the gathers fill back in

        def keep(buf: torch.Tensor) -> tuple[torch.Tensor, None]:
            whole[:] = [buf]
            return buf, None

        hops = [Hop(None, keep), *self.reduce_scatter_hops(fine, coarse, numel)]
        base, _ = self.span(fine, numel)
        for i, (inner, outer, group, members) in enumerate(reversed(steps)):
            size = numel // self.count(outer)
            starts = [self.span(outer, numel, m)[0] - base for m in members]
            mine, mine_size = self.span(inner, numel)

            def gather(part: torch.Tensor, group=group, size=size, starts=starts):
                out = whole[0]
                views = [out[s : s + size] for s in starts]
                return out, comm.all_gather_into_views(views, part, group, self.dim, async_op=True)

            hops.append(Hop((inner, outer, "ag"), gather))
            if i + 1 < len(steps):  # the next gather spreads the piece this one filled
                hops.append(Hop(None, functools.partial(_piece, start=mine - base, size=mine_size)))
        return hops

    def all_reduce(self, buf: torch.Tensor, fine: str, coarse: str, numel: int) -> torch.Tensor:
        """`all_reduce_hops` run one after the other: `buf` summed in place."""
        return _run(self.all_reduce_hops(fine, coarse, numel), buf)

    def gather(
        self,
        chunk: torch.Tensor,
        fine: str,
        coarse: str,
        out: torch.Tensor,
        numel: int,
        async_op: bool = False,
    ) -> PendingGather:
        """Fill `out` (this rank's `fine` chunk) from every rank's `coarse` chunk, this rank's
        being `chunk` (which must stay unchanged until `wait()`). With `async_op` the first
        collective is started and the rest run at `wait()` (each step needs the previous one's result)."""
        base, _ = self.span(fine, numel)
        steps = list(reversed(self.steps(fine, coarse)))

        def step(i: int, source: torch.Tensor, async_first: bool):
            inner, outer, group, members = steps[i]
            size = numel // self.count(outer)
            views = [
                out[s - base : s - base + size]
                for s in (self.span(outer, numel, m)[0] for m in members)
            ]
            return comm.all_gather_into_views(views, source, group, self.dim, async_op=async_first)

        def rest():
            for i in range(1, len(steps)):
                start, size = self.span(steps[i][1], numel)
                step(i, out[start - base : start - base + size], False)

        if not steps:  # nothing to gather from others: the chunk is the whole of `out`
            if chunk.data_ptr() != out.data_ptr():
                out.copy_(chunk)
            return PendingGather(None, lambda: None)
        return PendingGather(step(0, chunk, async_op), rest)


def level_pairs(fine: str, coarse: str, hierarchical: bool) -> list[tuple[str, str]]:
    """The (inner, outer) levels a collective from `fine` to `coarse` partitioning hops over: each
    adjacent pair of the chain between them, or the two ends at once when not `hierarchical`."""
    a, b = CHAIN.index(fine), CHAIN.index(coarse)
    if not hierarchical:
        return [(fine, coarse)] if a < b else []
    return list(zip(CHAIN[a:b], CHAIN[a + 1 : b + 1]))


def _run(hops: list[Hop], buf: torch.Tensor) -> torch.Tensor:
    """A chain's hops one after the other on this thread (the serial path)."""
    for hop in hops:
        buf, work = hop.start(buf)
        if work is not None:
            work.wait()
    return buf


def _piece(buf: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, None]:
    return buf[start : start + size], None


class PendingGather:
    """A gather under way: the first collective's work handle (None when nothing was sent) and the
    rest of the chain, run by `wait`."""

    def __init__(self, work, rest: Callable[[], None]):
        self.work, self.rest = work, rest

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.rest()
