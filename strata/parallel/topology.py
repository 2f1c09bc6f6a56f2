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

MoE experts have a layout of their own, `ExpertLayout` (Megatron-core's MoE parallel folding, made
by `expert_layout`): each pipeline stage's tp·dp ranks again, as `ep` consecutive ranks (the
expert-parallel group, which splits the experts) times `edp` (the expert-data-parallel group, over
which an expert's gradient is reduced and its state partitioned),

    rank = ep_rank + ep·(edp_rank + edp·pp_rank).

Both layouts are a `Grid`: the same group, level and chunk arithmetic over their own dimension
names, where the middle one (dp, edp) is the one ZeRO partitions over. Where an expert-parallel
group spans nodes it is also cut by node (`node_split`): its pieces inside each node ("ep_in_node")
and its columns across the nodes ("ep_across_nodes"), over which the hierarchical expert dispatch
sends. `build_topology` gives a Layout's groups as a `Topology` and an ExpertLayout's as an
`ExpertTopology`, reusing the dense layout's groups where the ranks coincide.

Placement rule for tp (checked by `layout_from_config`): tp must divide ranks_per_node or be a
multiple of it, so every tp group lies inside one node (Megatron's practice) or spans whole nodes;
never straddles a node boundary partway. tp is not checked against ranks_per_gpu: a tp group
that splits a GPU's GCDs is slower but correct. Expert-parallel groups are not held to it (the flat
dispatch works however they lie); the hierarchical one needs every group on several nodes in pieces
of one size, which `strata.config.vocabulary.ep_dispatch_problem` states for the config's checks
and `parallel.experts.make_dispatch` alike.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field
from typing import ClassVar, overload

from strata.config.vocabulary import (
    CHAIN,
    LEVELS,
    chain_level,
    expert_pool_problem,
    layout_problems,
    ranks_per_node,
    span_problem,
    uneven_sizes,
    unit_pieces,
)
from strata.errors import ConfigError

# torch.distributed and comm are imported where groups are made: the rank arithmetic alone serves
# `strata launch`'s memory check, which should not spend seconds importing torch.

DIMS = ("pp", "dp", "tp")  # a Layout's parallel dimensions, outermost to innermost
EXPERT_DIMS = ("pp", "edp", "ep")  # an ExpertLayout's
HARDWARE = ("node", "gpu", "gcd")  # hardware coordinates, outermost to innermost


class Grid(abc.ABC):
    """Ranks as a grid of three parallel dimensions, `DIMS` outermost first (the pipeline stage,
    the data dimension whose ranks reduce gradients and partition state, and an inner dimension of
    consecutive ranks), and how they sit on the hardware. `Layout` and `ExpertLayout` name them;
    everything here reads the degrees through `degree`. `ranks_per_node=None` means one node holds
    every rank."""

    DIMS: ClassVar[tuple[str, str, str]]
    # what messages call a data-dimension group, with its article
    DATA_GROUP: ClassVar[str]

    # declared by the dataclasses below
    pp: int
    ranks_per_node: int | None
    ranks_per_gpu: int

    def _check_degrees(self, **extra: int) -> None:
        """Programmer errors only: the config's checks report user mistakes before we get here."""
        degrees = {
            **{d: self.degree(d) for d in self.DIMS},
            "ranks_per_gpu": self.ranks_per_gpu,
            "ranks_per_node": self.node_size,
            **extra,
        }
        bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"{type(self).__name__}: {bad} must be positive integers")
        if self.world_size % self.node_size or self.node_size % self.ranks_per_gpu:
            raise ValueError(
                f"{type(self).__name__}: need ranks_per_gpu={self.ranks_per_gpu} | "
                f"ranks_per_node={self.node_size} | world size {self.world_size}"
            )

    def degree(self, dim: str) -> int:
        """How many ranks a group along `dim` (one of DIMS) holds."""
        if dim not in self.DIMS:
            raise ValueError(f"{type(self).__name__} has no dimension {dim!r}; it has {self.DIMS}")
        value: int = getattr(self, dim)
        return value

    @property
    def data_dim(self) -> str:
        """The dimension ZeRO partitions over and gradients are reduced over (dp, edp)."""
        return self.DIMS[1]

    @property
    def world_size(self) -> int:
        """Every rank: the product of the three degrees."""
        return self.degree(self.DIMS[0]) * self.degree(self.DIMS[1]) * self.degree(self.DIMS[2])

    @property
    def nodes(self) -> int:
        """How many nodes the ranks fill."""
        return self.world_size // self.node_size

    @property
    def node_size(self) -> int:
        """Ranks per node (the whole world when ranks_per_node is None)."""
        return self.world_size if self.ranks_per_node is None else self.ranks_per_node

    # --- parallel dimensions -------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """{outer: i, data: j, inner: k} of a global rank, e.g. {'pp': i, 'dp': j, 'tp': k} (the
        inverse of `rank_of`)."""
        outer, middle, inner = self.DIMS
        size, data = self.degree(inner), self.degree(middle)
        return {outer: rank // (size * data), middle: (rank // size) % data, inner: rank % size}

    def rank_of(self, **coords: int) -> int:
        """The global rank at coordinates given by dimension name (`rank_of(pp=0, dp=1, tp=0)`)."""
        outer, middle, inner = self.DIMS
        size, data = self.degree(inner), self.degree(middle)
        return coords[inner] + size * (coords[middle] + data * coords[outer])

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along `dim`: each list holds the ranks that differ only in that coordinate,
        ordered by it."""
        others = [d for d in self.DIMS if d != dim]
        groups = []
        for fixed in itertools.product(*(range(self.degree(d)) for d in others)):
            where = dict(zip(others, fixed))
            groups.append([self.rank_of(**{**where, dim: i}) for i in range(self.degree(dim))])
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
        blocks. With `within_dp`, each data-dimension group (in `group_ranks(data_dim)` order) cut
        by those units instead: the ranks that are data-parallel replicas of each other *and*
        share the unit, ordered by their data rank. Those pieces need not be equally large (see
        `replica_groups`)."""
        size = self.level_size(level)
        if not within_dp:
            return [list(range(start, start + size)) for start in range(0, self.world_size, size)]
        return [
            piece for group in self.group_ranks(self.data_dim) for piece in unit_pieces(group, size)
        ]

    def _even_pieces(self, group: list[int], level: str) -> list[list[int]]:
        """A data-dimension group cut by the units of `level`, which partitioning inside each unit
        needs equally large."""
        pieces = unit_pieces(group, self.level_size(level))
        sizes = uneven_sizes(pieces)
        if sizes:
            raise ConfigError(
                [
                    f"partitioning within each {level} needs every {level} to hold equally many "
                    f"ranks of {self.DATA_GROUP}, but with {self._described()}, "
                    f"ranks_per_node={self.node_size}, ranks_per_gpu={self.ranks_per_gpu} the "
                    f"{self.data_dim} group {group} is split into pieces of {sizes} ranks; "
                    f"{self._even_fix(level)}"
                ]
            )
        return pieces

    @abc.abstractmethod
    def _described(self) -> str:
        """The degrees as a message names them."""

    @abc.abstractmethod
    def _even_fix(self, level: str) -> str:
        """What makes a level's pieces of the data-dimension groups equally large."""

    def replica_groups(self, level: str) -> list[list[int]]:
        """For each data-dimension group, the ranks at the same position of their `within_dp`
        shard groups: the copies of one shard when state is partitioned inside each unit of
        `level` and replicated across units (`digit_groups(level, 'global')`). ConfigError when
        the pieces are uneven."""
        return self.digit_groups(level, "global")

    def digit_groups(self, inner: str, outer: str) -> list[list[int]]:
        """For each data-dimension group: the ranks that share one `outer` unit and the same
        position inside their `inner` units (inner no coarser than outer), ordered by data rank. A
        collective over such a group moves state partitioned inside `inner` units to partitioning
        inside `outer` units; (none, L) is L's shard group and (L, global) its replica group.
        Needs the group's pieces at both levels equally large (then every `outer` piece holds
        equally many `inner` pieces, units being nested); ConfigError otherwise."""
        outer_size = self.level_size(outer)
        out = []
        for group in self.group_ranks(self.data_dim):
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
        node. None where a group lies inside one node or its pieces are uneven (nothing to split:
        `strata.config.vocabulary.span_problem`)."""
        groups = self.group_ranks(dim)
        if any(span_problem(group, self.node_size) for group in groups):
            return None
        pieces, columns = [], []
        for group in groups:
            mine = unit_pieces(group, self.node_size)
            pieces += mine
            columns += [[p[j] for p in mine] for j in range(len(mine[0]))]
        return pieces, columns

    def nested_chunk(self, rank: int, level: str) -> tuple[int, int]:
        """(index, count): state partitioned at `level` is cut into `count` equal chunks across a
        data-dimension group and `rank` owns chunk `index`. Chunks are numbered finest unit first
        (the position inside the GPU is the most significant digit), the only numbering in which a
        rank's chunk at a coarser level lies inside its chunk at every finer one — so a ZeRO
        rank's optimizer shard sits inside the gradients and parameters it holds."""
        index, count = 0, 1
        stop = CHAIN.index(chain_level(level))
        for inner, outer in zip(CHAIN[:stop], CHAIN[1 : stop + 1]):
            group = next(g for g in self.digit_groups(inner, outer) if rank in g)
            index, count = index * len(group) + group.index(rank), count * len(group)
        return index, count


@dataclass(frozen=True)
class Layout(Grid):
    """The dense model's layout: degrees of tensor, pipeline and data parallelism (their product
    is the world size) and how ranks sit on the hardware. `ranks_per_node=None` means one node
    holds every rank."""

    DIMS: ClassVar[tuple[str, str, str]] = DIMS
    DATA_GROUP: ClassVar[str] = "a data-parallel group"

    tp: int = 1
    pp: int = 1
    # every rank of a pipeline stage's replica group: data parallel times context parallel
    dp: int = 1
    ranks_per_node: int | None = None
    ranks_per_gpu: int = 1
    # context parallel: consecutive runs of cp ranks of each dp group share their sequences
    cp: int = 1

    def __post_init__(self) -> None:
        self._check_degrees(cp=self.cp)
        if self.dp % self.cp:
            raise ValueError(
                f"Layout: cp={self.cp} must divide dp={self.dp} (dp counts the "
                "context-parallel ranks)"
            )

    @property
    def data_parallel(self) -> int:
        """Replicas that read different data: dp without the context-parallel ranks."""
        return self.dp // self.cp

    def context_groups(self) -> list[list[int]]:
        """Each dp group cut into runs of cp consecutive members: the ranks that split one sequence."""
        return [
            g[i : i + self.cp] for g in self.group_ranks("dp") for i in range(0, self.dp, self.cp)
        ]

    def _described(self) -> str:
        return f"parallel.tp={self.tp}, pp={self.pp}, dp={self.dp}"

    def _even_fix(self, level: str) -> str:
        return (
            f"make a pipeline stage's tp·dp = {self.tp * self.dp} ranks a multiple or a divisor "
            f"of the {self.level_size(level)} ranks of a {level}"
        )


@dataclass(frozen=True)
class ExpertLayout(Grid):
    """The MoE experts' layout (Megatron-core's MoE parallel folding, made by `expert_layout`):
    each pipeline stage's ranks as `ep` consecutive ranks (the expert-parallel group, which splits
    the experts) times `edp` (the expert-data-parallel group, over which an expert's gradient is
    reduced and its state partitioned), on the dense layout's hardware."""

    DIMS: ClassVar[tuple[str, str, str]] = EXPERT_DIMS
    DATA_GROUP: ClassVar[str] = "an expert-data-parallel group"

    ep: int = 1
    edp: int = 1
    pp: int = 1
    ranks_per_node: int | None = None
    ranks_per_gpu: int = 1

    def __post_init__(self) -> None:
        self._check_degrees()

    def _described(self) -> str:
        return f"parallel.ep={self.ep}, pp={self.pp} (edp={self.edp})"

    def _even_fix(self, level: str) -> str:
        return (
            f"make parallel.ep a multiple or a divisor of the {self.level_size(level)} ranks of a "
            f"{level}"
        )


def expert_layout(layout: Layout, ep: int) -> ExpertLayout:
    """The layout MoE experts are partitioned by: each pipeline stage's tp·dp ranks of `layout` as
    `ep` consecutive ranks (the expert-parallel group) times the rest (the expert-data-parallel
    group). With tp = 1 the expert-parallel groups are carved out of dp; ZeRO levels and link levels
    apply to it unchanged. `expert_layout(layout, 1)` is every tp·dp rank of a stage as one
    expert-data-parallel group (the routers' domain under tensor parallelism)."""
    problem = expert_pool_problem(ep, layout.tp, layout.dp)
    if problem:
        raise ConfigError([problem])
    return ExpertLayout(
        ep=ep,
        edp=layout.tp * layout.dp // ep,
        pp=layout.pp,
        ranks_per_node=layout.ranks_per_node,
        ranks_per_gpu=layout.ranks_per_gpu,
    )


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


def level_key(level: str, within_dp: bool = False, replica: bool = False, data: str = "dp") -> str:
    """The `Topology.groups` key of a hierarchy level's group: 'node', 'dp_node' (within the data
    dimension `data`: dp, or an ExpertTopology's edp), 'dp_node_replica' (its replica group)."""
    return f"{data}_{level}_replica" if replica else f"{data}_{level}" if within_dp else level


def digit_key(inner: str, outer: str, data: str = "dp") -> str:
    """The `Topology.groups` key of a `Grid.digit_groups(inner, outer)` group."""
    return f"{data}_{inner}_{outer}"


@dataclass
class RankGroups:
    """This process's place in a grid (a `Topology`'s Layout or an `ExpertTopology`'s ExpertLayout),
    with the process groups it belongs to (empty when the world is a single process).

    groups[dim] exists for each of the grid's DIMS in a distributed world. For every level of LEVELS
    there are `level_key(level)` (the unit's ranks), `level_key(level, within_dp=True)` (its shard
    group in the data dimension) and `level_key(level, replica=True)` (the replica group), but only
    where this rank's group has more than one member: a missing key means collectives over it are
    no-ops (comm's wrappers take None for that). `level_group` looks them up."""

    layout: Grid
    rank: int
    groups: dict[str, object] = field(default_factory=dict)
    # every membership build_topology made a group for (this rank's or not; the same on every rank)
    made: dict[tuple[int, ...], object] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's parallel coordinates, by dimension name (`Grid.coords`)."""
        return self.layout.coords(self.rank)

    @property
    def hardware_coords(self) -> dict[str, int]:
        """This rank's node, GPU and GCD (`Grid.hardware_coords`)."""
        return self.layout.hardware_coords(self.rank)

    def group(self, name: str):
        """This rank's process group `name` (a dimension, 'pp_ends', 'cp', 'ep_in_node', a level
        key); None when it would hold this rank alone, so collectives over it are no-ops."""
        if name in self.layout.DIMS and self.layout.degree(name) == 1:
            return None
        return self.groups.get(name)

    def digit_group(self, inner: str, outer: str) -> tuple[object, list[int]]:
        """This rank's `Grid.digit_groups(inner, outer)` group (None for a single rank) and its
        members' global ranks."""
        inner, outer = chain_level(inner), chain_level(outer)
        members = next(g for g in self.layout.digit_groups(inner, outer) if self.rank in g)
        return self.groups.get(digit_key(inner, outer, self.layout.data_dim)), members

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
        return self.groups.get(level_key(level, within_dp, replica, self.layout.data_dim))


@dataclass
class Topology(RankGroups):
    """This process's place in the dense model's Layout and its process groups: 'pp', 'dp', 'tp',
    'pp_ends', 'cp' and the levels' (see RankGroups)."""

    layout: Layout

    @property
    def dp_rank(self) -> int:
        """This rank's place in its dp group (context-parallel ranks counted)."""
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        """Ranks in a dp group: data replicas × cp."""
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
        """Replicas that read different data (dp without the context-parallel ranks)."""
        return self.layout.data_parallel

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0


@dataclass
class ExpertTopology(RankGroups):
    """This process's place in the MoE experts' ExpertLayout and its process groups: 'pp', 'edp',
    'ep', where the expert-parallel group spans nodes 'ep_in_node' and 'ep_across_nodes', and the
    levels' within edp ('edp_node', ...; see RankGroups)."""

    layout: ExpertLayout


def _named_group_ranks(layout: Grid) -> list[tuple[str, list[list[int]]]]:
    """Every group build_topology creates, by name, in creation order: the parallel dimensions
    (all of them, as before), then each hierarchy level's units, shard groups in the data dimension
    and replica groups (for a single-rank level the replica groups are the data groups: reused, not
    remade), the pipelines' ends, and a Layout's context-parallel groups or an ExpertLayout's
    expert-parallel groups cut by node."""
    data = layout.data_dim
    named = [(dim, layout.group_ranks(dim)) for dim in layout.DIMS]
    for level in LEVELS:
        named.append((level_key(level, data=data), layout.level_groups(level)))
        named.append(
            (level_key(level, True, data=data), layout.level_groups(level, within_dp=True))
        )
        try:
            named.append((level_key(level, replica=True, data=data), layout.replica_groups(level)))
        except ConfigError:
            pass  # uneven shard groups: partitioning at this level is impossible, so no replicas
    for i, inner in enumerate(CHAIN):
        for outer in CHAIN[i + 1 :]:
            try:
                named.append((digit_key(inner, outer, data), layout.digit_groups(inner, outer)))
            except ConfigError:
                pass  # this partitioning is impossible in this layout; the ZeRO engine reports it
    named.append(("pp_ends", layout.pipeline_end_ranks()))
    if isinstance(layout, Layout) and layout.cp > 1:
        named.append(("cp", layout.context_groups()))
    if isinstance(layout, ExpertLayout):
        split = layout.node_split("ep")
        if split is not None:  # what the hierarchical expert dispatch sends over
            named += [("ep_in_node", split[0]), ("ep_across_nodes", split[1])]
    return named


@overload
def build_topology(layout: Layout, rank: int, reuse: RankGroups | None = None) -> Topology: ...


@overload
def build_topology(
    layout: ExpertLayout, rank: int, reuse: RankGroups | None = None
) -> ExpertTopology: ...


def build_topology(layout: Grid, rank: int, reuse: RankGroups | None = None) -> RankGroups:
    """Create every named group (all ranks must call this, in the same order, as
    torch.distributed.new_group requires) and keep the ones this rank belongs to: a Layout's as a
    Topology, an ExpertLayout's as an ExpertTopology. A membership that recurs (e.g. 'dp_node'
    equal to 'dp' when dp stays in a node) reuses the first group made for it, and the whole world
    is WORLD, so layouts without a hierarchy create no extra groups (and no extra NCCL
    communicators). Two names sharing one group share its queue: as for any collective, every
    member must issue the operations on it in the same order. With `reuse` (the groups of another
    layout of the same world, e.g. the dense Topology when building the experts'), the groups it
    made are reused for the same memberships instead of made again (each would be one more NCCL
    communicator)."""
    import torch.distributed as dist

    from strata.parallel import comm

    topo: RankGroups
    if isinstance(layout, Layout):
        topo = Topology(layout, rank)
    elif isinstance(layout, ExpertLayout):
        topo = ExpertTopology(layout, rank)
    else:
        raise TypeError(f"build_topology: no topology for a {type(layout).__name__}")
    if not dist.is_initialized() or layout.world_size == 1:
        return topo
    made: dict[tuple[int, ...], object] = (
        dict(reuse.made)
        if reuse is not None
        else {tuple(range(layout.world_size)): dist.group.WORLD}
    )
    for name, groups in _named_group_ranks(layout):
        for ranks in groups:
            if len(ranks) == 1 and name not in layout.DIMS:
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
