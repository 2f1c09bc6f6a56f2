"""Rank arithmetic: the only place that maps a global rank to its (pp, dp, tp) coordinates and
builds the named process groups. Order follows Megatron: tp innermost and contiguous, then dp,
then pp, i.e. rank = tp_rank + tp·(dp_rank + dp·pp_rank)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

DIMS = ("pp", "dp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallel dimension; their product is the world size."""
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp': i, 'dp': j, 'tp': k} of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along `dim`: each list holds the ranks that differ only in that coordinate."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [d for d in DIMS if d != dim]
        groups = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            where = dict(zip(others, fixed))
            groups.append([self.rank_of(**{**where, dim: i}) for i in range(sizes[dim])])
        return groups


@dataclass
class Topology:
    """This process's place in the layout, with a process group per dimension (None when the
    world is a single process)."""
    layout: Layout
    rank: int
    groups: dict[str, object] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def build_topology(layout: Layout, rank: int) -> Topology:
    """Create every dimension's process groups (all ranks must call this, in the same order, as
    torch.distributed.new_group requires) and keep the ones this rank belongs to."""
    topo = Topology(layout, rank)
    if not dist.is_initialized() or layout.world_size == 1:
        return topo
    for dim in DIMS:
        for ranks in layout.group_ranks(dim):
            group = dist.group.WORLD if len(ranks) == layout.world_size else dist.new_group(ranks)
            if rank in ranks:
                topo.groups[dim] = group
    return topo
