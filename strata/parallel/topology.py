"""Rank arithmetic: the only place that maps a global rank to its coordinates and builds the named
process groups.

Parallel coordinates follow Megatron: tp innermost and contiguous, then dp, then pp,

    rank = tp_rank + tp·(dp_rank + dp·pp_rank).

Context parallelism is carved out of dp, innermost: a layout's dp counts the context-parallel ranks
too (data replicas × cp), and each dp group's runs of cp consecutive members ("cp" groups) split one
sequence. They hold the same weights, so gradient reduction and ZeRO partitions span all of dp.

Hardware coordinates follow the launchers (torchrun, srun): node n runs the contiguous ranks
[n·R, (n+1)·R), R = ranks_per_node, and local ranks fill the GPUs in order, G = ranks_per_gpu at a
time (G = 2 on a Frontier MI250X, whose two GCDs are two devices, one rank each):

    rank = gcd + G·(gpu + (R/G)·node).

A hierarchy *level* names the hardware unit whose ranks form one group (finest to coarsest):

    none    each rank alone: nothing is shared
    gcd     the ranks on one GCD (one device). Every rank drives its own device, so these are
            single ranks too — the same groups as "none"; the name exists so that settings can
            be written in hardware terms on any machine
    gpu     the ranks on one physical GPU: ranks_per_gpu of them (the GCD pair of an MI250X)
    node    the ranks on one node
    global  every rank

ZeRO-style partitioning happens inside data-parallel replicas (ranks with equal pp and tp
coordinates), so a level's *shard groups* are the dp groups cut by that unit
(`level_groups(level, within_dp=True)`), and its *replica groups* join the ranks that hold the
same shard in different units (`replica_groups(level)`): reduce-scatter in the former, all-reduce
across the latter, and together they span the dp group.

A tp group that spans nodes (an MoE expert layout's expert-parallel group) is also cut by node
(`node_split`): its pieces inside each node ("tp_in_node") and its columns across the nodes
("tp_across_nodes"), over which the hierarchical expert dispatch sends.

Placement rule for tp (checked by `layout_from_config`): tp must divide ranks_per_node or be a
multiple of it, so every tp group lies inside one node (Megatron's practice) or spans whole nodes;
never straddles a node boundary partway. tp is not checked against ranks_per_gpu: a tp group
that splits a GPU's GCDs is slower but correct.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from strata.config.vocabulary import CHAIN, LEVELS, chain_level, layout_problems, ranks_per_node
from strata.errors import ConfigError

# torch.distributed and comm are imported where groups are made: the rank arithmetic alone serves
# `strata launch`'s memory check, which should not spend seconds importing torch.

DIMS = ("pp", "dp", "tp")  # parallel dimensions, outermost to innermost
HARDWARE = ("node", "gpu", "gcd")  # hardware coordinates, outermost to innermost


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallel dimension (their product is the world size) and how ranks sit on
    the hardware. `ranks_per_node=None` means one node holds every rank."""

    tp: int = 1
    pp: int = 1
    # every rank of a pipeline stage's replica group: data parallel times context parallel
    dp: int = 1
    ranks_per_node: int | None = None
    ranks_per_gpu: int = 1
    # context parallel: consecutive runs of cp ranks of each dp group share their sequences
    cp: int = 1

    def __post_init__(self):
        # Programmer errors only: layout_from_config reports user mistakes before we get here.
        degrees = {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "ranks_per_gpu": self.ranks_per_gpu,
            "ranks_per_node": self.node_size,
            "cp": self.cp,
        }
        bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"Layout: {bad} must be positive integers")
        if self.dp % self.cp:
            raise ValueError(
                f"Layout: cp={self.cp} must divide dp={self.dp} (dp counts the "
                "context-parallel ranks)"
            )
        if self.world_size % self.node_size or self.node_size % self.ranks_per_gpu:
            raise ValueError(
                f"Layout: need ranks_per_gpu={self.ranks_per_gpu} | "
                f"ranks_per_node={self.node_size} "
                f"| world size {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def node_size(self) -> int:
        """Ranks per node (the whole world when ranks_per_node is None)."""
        return self.world_size if self.ranks_per_node is None else self.ranks_per_node

    # --- parallel dimensions -------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp': i, 'dp': j, 'tp': k} of a global rank (the inverse of `rank_of`)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    @property
    def data_parallel(self) -> int:
        """Replicas that read different data: dp without the context-parallel ranks."""
        return self.dp // self.cp

    def context_groups(self) -> list[list[int]]:
        """Each dp group cut into runs of cp consecutive members: the ranks that split one sequence."""
        return [
            g[i : i + self.cp] for g in self.group_ranks("dp") for i in range(0, self.dp, self.cp)
        ]

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along `dim`: each list holds the ranks that differ only in that coordinate,
        ordered by it."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [d for d in DIMS if d != dim]
        groups = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            where = dict(zip(others, fixed))
            groups.append([self.rank_of(**{**where, dim: i}) for i in range(sizes[dim])])
        return groups

    # --- hardware and hierarchy levels ---------------------------------------------------

    def hardware_coords(self, rank: int) -> dict[str, int]:
        """{'node': n, 'gpu': g, 'gcd': c}: the node, the GPU's index within the node and the
        GCD's index within the GPU (0 unless ranks_per_gpu > 1)."""
        g = self.ranks_per_gpu
        return {
            "node": rank // self.node_size,
            "gpu": (rank % self.node_size) // g,
            "gcd": rank % g,
        }

    def pipeline_end_ranks(self) -> list[list[int]]:
        """For every pipeline, its first and last rank: the two holders of a tied embedding
        (Megatron's embedding group). Empty without pipeline parallelism."""
        return [[g[0], g[-1]] for g in self.group_ranks("pp") if len(g) > 1]

    def link_level(self, ranks: list[int]) -> str:
        """The slowest link a group of ranks communicates over: 'intra-gpu' (the GCDs of one
        GPU), 'intra-node' or 'inter-node'."""
        coords = [self.hardware_coords(r) for r in ranks]
        if len({c["node"] for c in coords}) > 1:
            return "inter-node"
        return "intra-gpu" if len({c["gpu"] for c in coords}) == 1 else "intra-node"

    def ring_links(self, ranks: list[int]) -> list[str]:
        """The link level of each edge of the ring through `ranks` in their order (rank i to
        rank i+1, the last back to the first): the path ring collectives send over."""
        return [self.link_level([a, b]) for a, b in zip(ranks, ranks[1:] + ranks[:1])]

    def level_size(self, level: str) -> int:
        """Ranks in one unit of `level`."""
        sizes = {
            "none": 1,
            "gcd": 1,
            "gpu": self.ranks_per_gpu,
            "node": self.node_size,
            "global": self.world_size,
        }
        if level not in sizes:
            raise ValueError(f"unknown hierarchy level {level!r}; expected one of {LEVELS}")
        return sizes[level]

    def level_groups(self, level: str, within_dp: bool = False) -> list[list[int]]:
        """The ranks that share one unit of `level`, a partition of the world into contiguous
        blocks. With `within_dp`, each dp group (in `group_ranks('dp')` order) cut by those units
        instead: the ranks that are data-parallel replicas of each other *and* share the unit,
        ordered by dp rank. Those pieces need not be equally large (see `replica_groups`)."""
        size = self.level_size(level)
        if not within_dp:
            return [list(range(start, start + size)) for start in range(0, self.world_size, size)]
        return [piece for group in self.group_ranks("dp") for piece in self._pieces(group, level)]

    def _pieces(self, group: list[int], level: str) -> list[list[int]]:
        """A dp group cut by the units of `level`, in order."""
        size = self.level_size(level)
        return [list(p) for _, p in itertools.groupby(group, key=lambda r: r // size)]

    def _even_pieces(self, group: list[int], level: str) -> list[list[int]]:
        """`_pieces`, which partitioning inside each unit of `level` needs equally large."""
        pieces = self._pieces(group, level)
        sizes = sorted({len(p) for p in pieces})
        if len(sizes) > 1:
            raise ConfigError(
                [
                    f"partitioning within each {level} needs every {level} to hold equally many "
                    "ranks of a "
                    f"data-parallel group, but with parallel.tp={self.tp}, pp={self.pp}, "
                    f"dp={self.dp}, "
                    f"ranks_per_node={self.node_size}, ranks_per_gpu={self.ranks_per_gpu} the dp "
                    f"group {group} "
                    f"is split into pieces of {sizes} ranks; make a pipeline stage's tp·dp = "
                    f"{self.tp * self.dp} "
                    f"ranks a multiple or a divisor of the {self.level_size(level)} ranks of a "
                    f"{level}"
                ]
            )
        return pieces

    def replica_groups(self, level: str) -> list[list[int]]:
        """For each dp group, the ranks at the same position of their `within_dp` shard groups: the
        copies of one shard when state is partitioned inside each unit of `level` and replicated
        across units (`digit_groups(level, 'global')`). ConfigError when the pieces are uneven."""
        return self.digit_groups(level, "global")

    def digit_groups(self, inner: str, outer: str) -> list[list[int]]:
        """For each dp group: the ranks that share one `outer` unit and the same position inside
        their `inner` units (inner no coarser than outer), ordered by dp rank. A collective over
        such a group moves state partitioned inside `inner` units to partitioning inside `outer`
        units; (none, L) is L's dp shard group and (L, global) its replica group. Needs the dp
        group's pieces at both levels equally large (then every `outer` piece holds equally many
        `inner` pieces, units being nested); ConfigError otherwise."""
        outer_size = self.level_size(outer)
        out = []
        for group in self.group_ranks("dp"):
            self._even_pieces(group, outer)
            inners = self._even_pieces(group, inner)
            for _, same_outer in itertools.groupby(
                inners, key=lambda piece: piece[0] // outer_size
            ):
                pieces = list(same_outer)
                out += [[q[j] for q in pieces] for j in range(len(pieces[0]))]
        return out

    def node_span(self, dim: str) -> tuple[int, int]:
        """(ranks of a `dim` group on one node, nodes the group spans), for rank 0's group (groups
        along a dimension are laid out alike)."""
        group = self.group_ranks(dim)[0]
        nodes = len({r // self.node_size for r in group})
        return len(group) // nodes, nodes

    def node_split(self, dim: str) -> tuple[list[list[int]], list[list[int]]] | None:
        """The groups along `dim` cut by node: (pieces, columns). pieces: each group's ranks on one
        node; columns: each group's ranks at the same position of their pieces, one per node, by
        node. None where a group lies inside one node or its pieces are uneven (nothing to split)."""
        pieces, columns = [], []
        for group in self.group_ranks(dim):
            mine = [list(p) for _, p in itertools.groupby(group, key=lambda r: r // self.node_size)]
            if len(mine) == 1 or len({len(p) for p in mine}) > 1:
                return None
            pieces += mine
            columns += [[p[j] for p in mine] for j in range(len(mine[0]))]
        return pieces, columns

    def nested_chunk(self, rank: int, level: str) -> tuple[int, int]:
        """(index, count): state partitioned at `level` is cut into `count` equal chunks across a
        dp group and `rank` owns chunk `index`. Chunks are numbered finest unit first (the
        position inside the GPU is the most significant digit), the only numbering in which a
        rank's chunk at a coarser level lies inside its chunk at every finer one — so a ZeRO
        rank's optimizer shard sits inside the gradients and parameters it holds."""
        index, count = 0, 1
        stop = CHAIN.index(chain_level(level))
        for inner, outer in zip(CHAIN[:stop], CHAIN[1 : stop + 1]):
            group = next(g for g in self.digit_groups(inner, outer) if rank in g)
            index, count = index * len(group) + group.index(rank), count * len(group)
        return index, count


def expert_layout(layout: Layout, ep: int) -> Layout:
    """The layout MoE experts are partitioned by (Megatron-core's MoE parallel folding): each
    pipeline stage's tp·dp ranks as `ep` consecutive ranks (its "tp" dimension: the expert-parallel
    group, which splits the experts) times the rest (its "dp" dimension: the expert-data-parallel
    group, over which an expert's gradient is reduced and its state partitioned). With tp = 1 the
    expert-parallel groups are carved out of dp; ZeRO levels and link levels apply to it unchanged."""
    pool = layout.tp * layout.dp
    if pool % ep:
        raise ValueError(f"expert_layout: ep={ep} must divide tp·dp={pool}")
    return Layout(ep, layout.pp, pool // ep, layout.ranks_per_node, layout.ranks_per_gpu)


def layout_from_config(par, world_size: int, local_world_size: int | None = None) -> Layout:
    """The Layout that `par` (a strata.config.ParallelConfig) describes in a world of
    `world_size` ranks. `local_world_size` is the launcher's LOCAL_WORLD_SIZE, used when
    par.ranks_per_node is null (and without either, the world is one node). A set
    ranks_per_node wins over the launcher's count, so one machine can stand in for several
    nodes. Raises ConfigError listing every problem."""
    problems = layout_problems(par, world_size, local_world_size)
    if problems:
        raise ConfigError(problems)
    per_node, _ = ranks_per_node(par, world_size, local_world_size)
    return Layout(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp_size(world_size) * par.cp,
        ranks_per_node=per_node,
        ranks_per_gpu=par.ranks_per_gpu,
        cp=par.cp,
    )


def level_key(level: str, within_dp: bool = False, replica: bool = False) -> str:
    """The `Topology.groups` key of a hierarchy level's group: 'node', 'dp_node' (within dp),
    'dp_node_replica' (its replica group)."""
    return f"dp_{level}_replica" if replica else f"dp_{level}" if within_dp else level


def digit_key(inner: str, outer: str) -> str:
    """The `Topology.groups` key of a `Layout.digit_groups(inner, outer)` group."""
    return f"dp_{inner}_{outer}"


@dataclass
class Topology:
    """This process's place in the layout, with the process groups it belongs to (empty when
    the world is a single process).

    groups['pp'|'dp'|'tp'] always exist in a distributed world. For every level of LEVELS there
    are `level_key(level)` (the unit's ranks), `level_key(level, within_dp=True)` (its dp shard
    group) and `level_key(level, replica=True)` (the replica group), but only where this rank's
    group has more than one member: a missing key means collectives over it are no-ops (comm's
    wrappers take None for that). `level_group` looks them up."""

    layout: Layout
    rank: int
    groups: dict[str, object] = field(default_factory=dict)
    # every membership build_topology made a group for (this rank's or not; the same on every rank)
    made: dict[tuple[int, ...], object] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def hardware_coords(self) -> dict[str, int]:
        return self.layout.hardware_coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (which part of each sequence it holds)."""
        return self.dp_rank % self.layout.cp

    @property
    def data_rank(self) -> int:
        """Which replica's share of the data this rank reads (its context-parallel group's)."""
        return self.dp_rank // self.layout.cp

    @property
    def data_size(self) -> int:
        return self.layout.data_parallel

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, name: str):
        """This rank's process group `name` ('tp', 'dp', 'pp', 'pp_ends', 'cp', a level key); None when
        it would hold this rank alone, so collectives over it are no-ops."""
        if name in DIMS and getattr(self.layout, name) == 1:
            return None
        return self.groups.get(name)

    def digit_group(self, inner: str, outer: str) -> tuple[object, list[int]]:
        """This rank's `Layout.digit_groups(inner, outer)` group (None for a single rank) and its
        members' global ranks."""
        inner, outer = chain_level(inner), chain_level(outer)
        members = next(g for g in self.layout.digit_groups(inner, outer) if self.rank in g)
        return self.groups.get(digit_key(inner, outer)), members

    def dedicated_digit_group(self, inner: str, outer: str):
        """A process group of this rank's `digit_group(inner, outer)` members that nothing else
        uses (created anew: every rank must call this, in the same order), for work that runs
        asynchronously beside the main thread's collectives — CO2's outer all-reduce. None for a
        single rank."""
        import torch.distributed as dist

        from strata.parallel import comm

        mine = None
        for ranks in self.layout.digit_groups(chain_level(inner), chain_level(outer)):
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
                comm.register_group(
                    group, self.layout.link_level(ranks), self.layout.ring_links(ranks)
                )
        return mine

    def level_group(self, level: str, within_dp: bool = False, replica: bool = False):
        """This rank's group at a hierarchy level (see the class doc); None for a single rank."""
        self.layout.level_size(level)  # rejects unknown levels
        return self.groups.get(level_key(level, within_dp, replica))


def _named_group_ranks(layout: Layout) -> list[tuple[str, list[list[int]]]]:
    """Every group build_topology creates, by name, in creation order: the parallel dimensions
    (all of them, as before), then each hierarchy level's units, dp shard groups and replica
    groups (for a single-rank level the replica groups are the dp groups: reused, not remade)."""
    named = [(dim, layout.group_ranks(dim)) for dim in DIMS]
    for level in LEVELS:
        named.append((level_key(level), layout.level_groups(level)))
        named.append((level_key(level, within_dp=True), layout.level_groups(level, within_dp=True)))
        try:
            named.append((level_key(level, replica=True), layout.replica_groups(level)))
        except ConfigError:
            pass  # uneven shard groups: partitioning at this level is impossible, so no replicas
    for i, inner in enumerate(CHAIN):
        for outer in CHAIN[i + 1 :]:
            try:
                named.append((digit_key(inner, outer), layout.digit_groups(inner, outer)))
            except ConfigError:
                pass  # this partitioning is impossible in this layout; the ZeRO engine reports it
    named.append(("pp_ends", layout.pipeline_end_ranks()))
    if layout.cp > 1:
        named.append(("cp", layout.context_groups()))
    split = layout.node_split("tp")
    if split is not None:  # tp groups spanning nodes (an expert layout's expert-parallel groups)
        named += [("tp_in_node", split[0]), ("tp_across_nodes", split[1])]
    return named


def build_topology(layout: Layout, rank: int, reuse: Topology | None = None) -> Topology:
    """Create every named group (all ranks must call this, in the same order, as
    torch.distributed.new_group requires) and keep the ones this rank belongs to. A membership
    that recurs (e.g. 'dp_node' equal to 'dp' when dp stays in a node) reuses the first group
    made for it, and the whole world is WORLD, so layouts without a hierarchy create no extra
    groups (and no extra NCCL communicators). Two names sharing one group share its queue: as
    for any collective, every member must issue the operations on it in the same order. With
    `reuse` (another layout of the same world, e.g. the MoE experts' `expert_layout`), the groups it
    made are reused for the same memberships instead of made again (each would be one more NCCL
    communicator)."""
    import torch.distributed as dist

    from strata.parallel import comm

    topo = Topology(layout, rank)
    if not dist.is_initialized() or layout.world_size == 1:
        return topo
    made: dict[tuple[int, ...], object] = (
        dict(reuse.made)
        if reuse is not None
        else {tuple(range(layout.world_size)): dist.group.WORLD}
    )
    for name, groups in _named_group_ranks(layout):
        for ranks in groups:
            if len(ranks) == 1 and name not in DIMS:
                continue  # a hierarchy group of one rank: no group, collectives over it are no-ops
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
            if rank in ranks:
                topo.groups[name] = made[tuple(ranks)]
    for members, group in made.items():  # byte accounting per link level
        if rank in members and len(members) > 1:
            comm.register_group(
                group, layout.link_level(list(members)), layout.ring_links(list(members))
            )
    comm.register_link_resolver(lambda a, b: layout.link_level([a, b]))
    topo.made = made
    return topo
