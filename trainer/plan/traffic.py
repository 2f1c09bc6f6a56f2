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

from strata.parallel.topology import CHAIN, Layout
from strata.trainer.plan.cluster import LINKS, Cluster
from strata.trainer.plan.shapes import chunk_counts


@dataclass
class Traffic:
    """Bytes one rank sends per link level, and the seconds they take, of some collectives."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    seconds: float = 0.0

    def add(self, other: Traffic, times: float = 1.0) -> None:
        for k, v in other.bytes.items():
            self.bytes[k] += v * times
        self.seconds += other.seconds * times

    def scaled(self, times: float) -> Traffic:
        out = Traffic()
        out.add(self, times)
        return out


@lru_cache(maxsize=4096)
def edge_load(layout: Layout, groups: tuple[tuple[int, ...], ...]) -> dict[str, int]:
    """For rings over `groups` (all running at once): how many ring edges leave node 0 (inter-node),
    leave GPU 0 of node 0 for another GPU of the node (intra-node), and join the two GCDs of GPU 0
    (intra-gpu) — the number of flows each of those physical links carries."""
    load = dict.fromkeys(LINKS, 0)
    for ring in groups:
        if len(ring) < 2:
            continue
        for a, b in zip(ring, ring[1:] + ring[:1]):
            ha, hb = layout.hardware_coords(a), layout.hardware_coords(b)
            if ha["node"] != 0:
                continue
            if hb["node"] != 0:
                load["inter-node"] += 1
            elif ha["gpu"] == 0 and hb["gpu"] != 0:
                load["intra-node"] += 1
            elif ha["gpu"] == 0 and hb["gpu"] == 0:
                load["intra-gpu"] += 1
    return load


def ring_time(cluster: Cluster, layout: Layout, groups: list[list[int]], per_edge: float, steps: int) -> Traffic:
    """A ring collective over each of `groups` at once sending `per_edge` bytes on every edge in
    `steps` latency-bound steps: the bytes a rank of rank 0's ring sends per level (on average
    over its members: each sends on its own edge), and the time of the most loaded link."""
    out = Traffic()
    ring = next((g for g in groups if 0 in g), groups[0])
    if len(ring) < 2 or per_edge <= 0:
        return out
    load = edge_load(layout, tuple(tuple(g) for g in groups))
    links = layout.ring_links(ring)  # per rank, averaged over the ring: each sends on its own edge
    for link in links:
        out.bytes[link] += per_edge / len(links)
    busy = [load[link] * per_edge / cluster.bandwidth_bytes_s(link) for link in LINKS if load[link]]
    slowest = max((link for link in LINKS if load[link]), key=LINKS.index)
    out.seconds = max(busy) + steps * cluster.latency_s[slowest]
    return out


def hop_pairs(fine: str, coarse: str, hierarchical: bool) -> list[tuple[str, str]]:
    a, b = CHAIN.index(fine), CHAIN.index(coarse)
    if a >= b:
        return []
    if not hierarchical:
        return [(fine, coarse)]
    return list(zip(CHAIN[a:b], CHAIN[a + 1 : b + 1]))


@lru_cache(maxsize=4096)
def _groups(layout: Layout, inner: str, outer: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in layout.digit_groups(inner, outer))


def _count(layout: Layout, level: str) -> int:
    return chunk_counts(layout)[level]


def reduce_scatter(
    cluster: Cluster, layout: Layout, padded_bytes: float, fine: str, coarse: str, hierarchical: bool
) -> Traffic:
    """A flat buffer (`padded_bytes` whole) partitioned at `fine` reduce-scattered to `coarse`.
    An all-gather from `coarse` back to `fine` moves the same bytes the other way."""
    out = Traffic()
    for inner, outer in hop_pairs(fine, coarse, hierarchical):
        groups = [list(g) for g in _groups(layout, inner, outer)]
        size = len(next(g for g in groups if 0 in g))
        if size < 2:
            continue
        chunk = padded_bytes / _count(layout, inner)
        out.add(ring_time(cluster, layout, groups, chunk * (size - 1) / size, size - 1))
    return out


def all_reduce(
    cluster: Cluster, layout: Layout, padded_bytes: float, fine: str, coarse: str, hierarchical: bool
) -> Traffic:
    """Sum a `fine` chunk over its copies up to `coarse`: one all-reduce over one level, else a
    reduce-scatter up and an all-gather back down (`Routes.all_reduce_hops`)."""
    pairs = [
        (i, o)
        for i, o in hop_pairs(fine, coarse, hierarchical)
        if len(next(g for g in _groups(layout, i, o) if 0 in g)) > 1
    ]
    if len(pairs) >= 2:
        return reduce_scatter(cluster, layout, padded_bytes, fine, coarse, hierarchical).scaled(2)
    out = Traffic()
    for inner, outer in pairs:
        groups = [list(g) for g in _groups(layout, inner, outer)]
        size = len(next(g for g in groups if 0 in g))
        chunk = padded_bytes / _count(layout, inner)
        out.add(ring_time(cluster, layout, groups, 2 * chunk * (size - 1) / size, 2 * (size - 1)))
    return out


def dim_all_reduce(cluster: Cluster, layout: Layout, dim: str, nbytes: float) -> Traffic:
    """An all-reduce of `nbytes` over every `dim` group at once (tensor parallelism's)."""
    groups = layout.group_ranks(dim)
    size = len(groups[0])
    if size < 2:
        return Traffic()
    return ring_time(cluster, layout, groups, 2 * nbytes * (size - 1) / size, 2 * (size - 1))


def pipeline_send(cluster: Cluster, layout: Layout, nbytes: float) -> Traffic:
    """Every rank of pipeline stage 0 sending `nbytes` to its peer in stage 1 at once (the link a
    stage boundary crosses, shared by the tp·dp ranks that cross it together)."""
    pairs = [[g[0], g[1]] for g in layout.group_ranks("pp") if len(g) > 1]
    if not pairs:
        return Traffic()
    # a send is half a two-rank ring: one edge each way, the edge back idle
    return ring_time(cluster, layout, pairs, nbytes, 1)


def co2_outer(cluster: Cluster, layout: Layout, chunk_bytes: float) -> Traffic:
    """CO2's outer all-reduce of each rank's optimizer chunk across the nodes."""
    groups = [list(g) for g in _groups(layout, "node", "global")]
    size = len(next(g for g in groups if 0 in g))
    if size < 2:
        return Traffic()
    return ring_time(cluster, layout, groups, 2 * chunk_bytes * (size - 1) / size, 2 * (size - 1))
