"""The communication a layout does in one step, as the engine does it, in bytes per rank per link
level and in seconds on a cluster's links: data-parallel/ZeRO collectives hop by hop over the
topology's digit groups (`parallel.routes`), tensor-parallel all-reduces, pipeline sends, and
CO2's outer all-reduce.

A ring over a group sends (g-1)/g of its input per rank for a reduce-scatter (as much for an
all-gather of the result, twice that for an all-reduce), on every edge of the ring at once; a hop
takes as long as its most loaded link: the node's network carries every edge that leaves the node
(all groups of a hop run together), a GPU's link every edge that leaves the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from strata.parallel.routes import level_pairs
from strata.parallel.topology import Layout, expert_layout
from strata.plan.cluster import LINKS, Cluster
from strata.plan.shapes import chunk_counts


@dataclass
class Traffic:
    """Bytes one rank sends per link level, and the seconds they take, of some collectives."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    seconds: float = 0.0

    def add(self, other: Traffic, times: float = 1.0) -> None:
        """Add `other`'s bytes and seconds, `times` over."""
        for k, v in other.bytes.items():
            self.bytes[k] += v * times
        self.seconds += other.seconds * times

    def scaled(self, times: float) -> Traffic:
        """A copy with every byte count and the seconds multiplied by `times`."""
        out = Traffic()
        out.add(self, times)
        return out


Groups = tuple[tuple[int, ...], ...]


@lru_cache(maxsize=4096)
def edge_load(layout: Layout, groups: Groups) -> dict[str, int]:
    """For rings over `groups` (all running at once): how many ring edges leave node 0 (inter-node),
    leave GPU 0 of node 0 for another GPU of the node (intra-node), and join the two GCDs of GPU 0
    (intra-gpu) — the number of flows each of those physical links carries."""
    load = dict.fromkeys(LINKS, 0)
    for ring in groups:
        for a, b in zip(ring, ring[1:] + ring[:1]) if len(ring) > 1 else ():
            where = layout.hardware_coords(a)
            link = layout.link_level([a, b])
            if where["node"] == 0 and (link == "inter-node" or where["gpu"] == 0):
                load[link] += 1
    return load


def ring_time(
    cluster: Cluster, layout: Layout, groups: Groups, per_edge: float, steps: int
) -> Traffic:
    """A ring collective over each of `groups` at once sending `per_edge` bytes on every edge in
    `steps` latency-bound steps: the bytes a rank of rank 0's ring sends per level (on average
    over its members: each sends on its own edge), and the time of the most loaded link."""
    out = Traffic()
    ring = _ring_of_rank0(groups)
    if len(ring) < 2 or per_edge <= 0:
        return out
    load = edge_load(layout, groups)
    links = layout.ring_links(list(ring))
    for link in links:
        out.bytes[link] += per_edge / len(links)
    busy = [load[link] * per_edge / cluster.bandwidth_bytes_s(link) for link in LINKS if load[link]]
    slowest = max((link for link in LINKS if load[link]), key=LINKS.index)
    out.seconds = max(busy) + steps * cluster.latency_s[slowest]
    return out


def ring_all_reduce(cluster: Cluster, layout: Layout, groups: Groups, nbytes: float) -> Traffic:
    """A ring all-reduce of `nbytes` over each of `groups` at once: 2(g-1)/g of it per edge."""
    size = len(_ring_of_rank0(groups))
    return ring_time(cluster, layout, groups, 2 * nbytes * (size - 1) / size, 2 * (size - 1))


def _ring_of_rank0(groups: Groups) -> tuple[int, ...]:
    return next((g for g in groups if 0 in g), groups[0])


@lru_cache(maxsize=4096)
def _groups(layout: Layout, inner: str, outer: str) -> Groups:
    return tuple(tuple(g) for g in layout.digit_groups(inner, outer))


def _hops(
    layout: Layout, fine: str, coarse: str, hierarchical: bool
) -> list[tuple[str, Groups, int]]:
    """(inner level, digit groups, group size) of each hop that has more than one rank in it."""
    out = []
    for inner, outer in level_pairs(fine, coarse, hierarchical):
        groups = _groups(layout, inner, outer)
        if len(_ring_of_rank0(groups)) > 1:
            out.append((inner, groups, len(_ring_of_rank0(groups))))
    return out


def reduce_scatter(
    cluster: Cluster,
    layout: Layout,
    padded_bytes: float,
    fine: str,
    coarse: str,
    hierarchical: bool,
) -> Traffic:
    """A flat buffer (`padded_bytes` whole) partitioned at `fine` reduce-scattered to `coarse`.
    An all-gather from `coarse` back to `fine` moves the same bytes the other way."""
    out = Traffic()
    for inner, groups, size in _hops(layout, fine, coarse, hierarchical):
        chunk = padded_bytes / chunk_counts(layout)[inner]
        out.add(ring_time(cluster, layout, groups, chunk * (size - 1) / size, size - 1))
    return out


def all_reduce(
    cluster: Cluster,
    layout: Layout,
    padded_bytes: float,
    fine: str,
    coarse: str,
    hierarchical: bool,
) -> Traffic:
    """Sum a `fine` chunk over its copies up to `coarse`: one all-reduce over one level, else a
    reduce-scatter up and an all-gather back down (`Routes.all_reduce_hops`)."""
    hops = _hops(layout, fine, coarse, hierarchical)
    if len(hops) >= 2:
        return reduce_scatter(cluster, layout, padded_bytes, fine, coarse, hierarchical).scaled(2)
    out = Traffic()
    for inner, groups, _ in hops:
        out.add(
            ring_all_reduce(cluster, layout, groups, padded_bytes / chunk_counts(layout)[inner])
        )
    return out


def dim_all_reduce(cluster: Cluster, layout: Layout, dim: str, nbytes: float) -> Traffic:
    """An all-reduce of `nbytes` over every `dim` group at once (tensor parallelism's)."""
    return ring_all_reduce(
        cluster, layout, tuple(tuple(g) for g in layout.group_ranks(dim)), nbytes
    )


def context_exchange(cluster: Cluster, layout: Layout, nbytes: float, mode: str) -> Traffic:
    """One exchange of context parallelism's attention over every cp group at once: `ring`, each rank
    passing `nbytes` to the next (a ring step); `alltoall`, each rank sending (cp−1)/cp of its
    `nbytes` to the others (as much per rank as a ring's reduce-scatter moves)."""
    groups = tuple(tuple(g) for g in layout.context_groups())
    size = len(_ring_of_rank0(groups))
    if mode == "ring":
        return ring_time(cluster, layout, groups, nbytes, 1)
    return ring_time(cluster, layout, groups, nbytes * (size - 1) / size, size - 1)


def pipeline_send(cluster: Cluster, layout: Layout, nbytes: float) -> Traffic:
    """Every rank of pipeline stage 0 sending `nbytes` to its peer in stage 1 at once (the link a
    stage boundary crosses, shared by the tp·dp ranks that cross it together)."""
    pairs = tuple((g[0], g[1]) for g in layout.group_ranks("pp") if len(g) > 1)
    # a send is half a two-rank ring: one edge each way, the edge back idle
    return ring_time(cluster, layout, pairs, nbytes, 1) if pairs else Traffic()


def co2_outer(cluster: Cluster, layout: Layout, chunk_bytes: float) -> Traffic:
    """CO2's outer all-reduce of each rank's optimizer chunk over its copies in the other nodes."""
    return ring_all_reduce(cluster, layout, _groups(layout, "node", "global"), chunk_bytes)


def expert_exchange(
    cluster: Cluster,
    layout: Layout,
    ep: int,
    tokens: float,
    row_bytes: float,
    top_k: int,
    nodes_per_token: float | None,
) -> Traffic:
    """One all-to-all of an MoE layer (its dispatch, or the way back): each rank's `tokens` tokens
    to the `top_k` experts they chose in their expert-parallel group (`ep` consecutive ranks of the
    stage), every group at once, routing balanced (a copy's expert uniform over the group). Flat
    (`nodes_per_token` None): one row per copy, those for the other nodes on the inter-node link.
    Hierarchical: `nodes_per_token` rows per token to distinct nodes (one of them may be this rank's
    own), each with its k expert ids and gates, then the node's fan-out over its own links."""
    out = Traffic()
    # the expert-parallel group per node, its nodes
    local, nodes = expert_layout(layout, ep).node_span("ep")
    rows = tokens * top_k
    if nodes_per_token is None:
        inter = rows * (ep - local) / ep * row_bytes
        intra = rows * (local - 1) / ep * row_bytes
    else:
        inter = tokens * nodes_per_token * (nodes - 1) / nodes * (row_bytes + 8 * top_k)
        intra = rows * (local - 1) / local * row_bytes
    out.bytes["inter-node"], out.bytes["intra-node"] = inter, intra
    if inter:  # every rank of the node sends across at once
        out.seconds += (
            layout.node_size * inter / cluster.bandwidth_bytes_s("inter-node")
            + cluster.latency_s["inter-node"]
        )
    if intra:
        out.seconds += (
            intra / cluster.bandwidth_bytes_s("intra-node") + cluster.latency_s["intra-node"]
        )
    if nodes_per_token is None and inter and intra:  # one exchange: the two links carry it at once
        out.seconds -= min(
            layout.node_size * inter / cluster.bandwidth_bytes_s("inter-node"),
            intra / cluster.bandwidth_bytes_s("intra-node"),
        )
    return out
