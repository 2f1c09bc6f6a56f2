"""Rank layout checked two ways: pure properties of `Layout`, and group membership and coordinates
against an independent reference, megatron-core's `parallel_state.initialize_model_parallel`
(default order "tp-cp-ep-dp-pp": tp innermost, then dp, then pp — the order we claim to follow).

Megatron runs in one child process (its import is slow and its module-level state, plus the
"fake" process-group backend, must not leak into other tests), which builds a fake world of size
N once per (layout, rank) and reports the groups as JSON. The fake backend creates groups without
any communication, so every rank of every layout is covered in a few seconds. Megatron's extra
gloo copies of its groups (`create_gloo_process_groups`) are turned off: the fake world cannot
host a gloo subgroup, and they duplicate the membership of the groups compared here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from strata.config import ParallelConfig
from strata.config.vocabulary import ep_dispatch_problem
from strata.errors import ConfigError
from strata.parallel.topology import (
    CHAIN,
    DIMS,
    EXPERT_DIMS,
    HARDWARE,
    LEVELS,
    ExpertLayout,
    ExpertTopology,
    Grid,
    Layout,
    Topology,
    build_topology,
    digit_key,
    expert_layout,
    layout_from_config,
    level_key,
)

from worlds import REPO, TESTS, join_world, run_world

# (tp, pp, dp)
LAYOUTS = [
    (2, 1, 1),
    (1, 2, 1),
    (1, 4, 1),
    (1, 1, 2),
    (2, 2, 1),
    (2, 1, 2),
    (1, 2, 2),
    (2, 2, 2),
    (4, 2, 1),
    (2, 4, 1),
    (4, 1, 2),
    (1, 2, 4),
    (2, 1, 4),
    (3, 2, 2),
    (2, 3, 2),
]
IDS = [f"tp{tp}-pp{pp}-dp{dp}" for tp, pp, dp in LAYOUTS]


def layout_of(tp: int, pp: int, dp: int) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp)


# ---------------------------------------------------------------------------------------------
# Pure Layout properties (no megatron)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS + [(1, 1, 1)], ids=IDS + ["single"])
def test_layout_groups_partition_the_world(tp, pp, dp):
    layout = layout_of(tp, pp, dp)
    n = layout.world_size
    assert n == tp * pp * dp
    degree = {"tp": tp, "pp": pp, "dp": dp}
    for dim in DIMS:
        groups = layout.group_ranks(dim)
        assert len(groups) == n // degree[dim], dim
        assert all(len(g) == degree[dim] for g in groups), (dim, groups)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(n)), (dim, groups)  # every rank exactly once
        for (
            g
        ) in groups:  # a group is the ranks that differ only in `dim`, ordered by that coordinate
            assert [layout.coords(r)[dim] for r in g] == list(range(degree[dim])), (dim, g)
            for other in DIMS:
                if other != dim:
                    assert len({layout.coords(r)[other] for r in g}) == 1, (dim, other, g)


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS + [(1, 1, 1)], ids=IDS + ["single"])
def test_layout_coords_round_trip(tp, pp, dp):
    layout = layout_of(tp, pp, dp)
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert set(c) == set(DIMS)
        assert 0 <= c["tp"] < tp and 0 <= c["pp"] < pp and 0 <= c["dp"] < dp, (r, c)
        assert layout.rank_of(**c) == r
        seen.add((c["pp"], c["dp"], c["tp"]))
    assert len(seen) == layout.world_size  # coords is a bijection onto the grid
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                assert layout.coords(layout.rank_of(pp=p, dp=d, tp=t)) == {
                    "pp": p,
                    "dp": d,
                    "tp": t,
                }


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=IDS)
def test_layout_tp_groups_are_contiguous(tp, pp, dp):
    layout = layout_of(tp, pp, dp)
    groups = layout.group_ranks("tp")
    assert sorted(groups) == [list(range(s, s + tp)) for s in range(0, layout.world_size, tp)]
    # and dp is next: a pipeline stage is one contiguous block of tp·dp ranks
    stage = tp * dp
    for r in range(layout.world_size):
        assert layout.coords(r)["pp"] == r // stage


# ---------------------------------------------------------------------------------------------
# Hardware hierarchy (pure properties): node ⊃ gpu ⊃ gcd, and their cuts of the dp groups
# ---------------------------------------------------------------------------------------------

# (tp, pp, dp, ranks_per_node, ranks_per_gpu)
HW_LAYOUTS = [
    (1, 1, 8, 4, 2),
    (2, 2, 4, 4, 2),
    (2, 1, 4, 2, 2),
    (4, 2, 2, 8, 2),
    (1, 2, 4, 2, 1),
    (2, 2, 2, 2, 2),
    (8, 1, 2, 4, 2),
    (2, 3, 2, 4, 2),
    (1, 1, 16, 8, 2),
    (2, 1, 8, 8, 2),
    (1, 4, 2, 4, 4),
    (2, 2, 2, 8, 1),
]
HW_IDS = [f"tp{a}-pp{b}-dp{c}-rpn{d}-rpg{e}" for a, b, c, d, e in HW_LAYOUTS]


def hw_layout(tp, pp, dp, rpn, rpg) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, ranks_per_node=rpn, ranks_per_gpu=rpg)


def _is_partition(groups, n):
    return sorted(r for g in groups for r in g) == list(range(n))


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg", HW_LAYOUTS, ids=HW_IDS)
def test_hardware_coords_follow_the_launcher(tp, pp, dp, rpn, rpg):
    layout = hw_layout(tp, pp, dp, rpn, rpg)
    seen = set()
    for r in range(layout.world_size):
        hw = layout.hardware_coords(r)
        assert tuple(hw) == HARDWARE
        assert (
            0 <= hw["gcd"] < rpg
            and 0 <= hw["gpu"] < rpn // rpg
            and 0 <= hw["node"] < layout.world_size // rpn
        )
        # torchrun/srun: node n holds ranks [n·rpn, (n+1)·rpn); local ranks fill GPUs rpg at a time
        assert r == hw["gcd"] + rpg * (hw["gpu"] + (rpn // rpg) * hw["node"]), (r, hw)
        seen.add((hw["node"], hw["gpu"], hw["gcd"]))
        assert set(layout.coords(r)) == set(DIMS)  # parallel coords are unchanged by the hardware
    assert len(seen) == layout.world_size


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg", HW_LAYOUTS, ids=HW_IDS)
def test_level_groups_are_contiguous_nested_units(tp, pp, dp, rpn, rpg):
    layout = hw_layout(tp, pp, dp, rpn, rpg)
    n = layout.world_size
    expected_size = {"none": 1, "gcd": 1, "gpu": rpg, "node": rpn, "global": n}
    shared = {
        "none": HARDWARE + ("rank",),
        "gcd": HARDWARE,
        "gpu": ("node", "gpu"),
        "node": ("node",),
        "global": (),
    }
    for level in LEVELS:
        groups = layout.level_groups(level)
        size = expected_size[level]
        assert layout.level_size(level) == size
        assert groups == [list(range(s, s + size)) for s in range(0, n, size)], (
            level
        )  # contiguous blocks
        for g in groups:  # a unit's ranks share exactly the coordinates above that unit
            hw = [{**layout.hardware_coords(r), "rank": r} for r in g]
            assert all(len({h[k] for h in hw}) == 1 for k in shared[level]), (level, g)
    for finer, coarser in zip(
        LEVELS, LEVELS[1:]
    ):  # every unit lies inside one unit of the next level
        outer = layout.level_groups(coarser)
        assert all(any(set(g) <= set(o) for o in outer) for g in layout.level_groups(finer)), (
            finer,
            coarser,
        )
    for r in range(
        n
    ):  # tp placement rule holds for these layouts: a tp group in one node or whole nodes
        tp_group = next(g for g in layout.group_ranks("tp") if r in g)
        nodes = {layout.hardware_coords(x)["node"] for x in tp_group}
        assert len(nodes) == 1 or len(tp_group) == len(nodes) * rpn


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg", HW_LAYOUTS, ids=HW_IDS)
def test_level_groups_within_dp_are_the_intersections(tp, pp, dp, rpn, rpg):
    layout = hw_layout(tp, pp, dp, rpn, rpg)
    n = layout.world_size
    dp_groups = layout.group_ranks("dp")
    for level in LEVELS:
        pieces = layout.level_groups(level, within_dp=True)
        assert _is_partition(pieces, n), level
        # brute force: every non-empty dp-group ∩ unit, members in dp order
        brute = [
            [r for r in g if r in set(u)] for g in dp_groups for u in layout.level_groups(level)
        ]
        assert sorted(pieces) == sorted(b for b in brute if b), level
        for piece in pieces:
            assert [layout.coords(r)["dp"] for r in piece] == sorted(
                layout.coords(r)["dp"] for r in piece
            )
        replicas = layout.replica_groups(level)
        assert _is_partition(replicas, n), level
        for g in dp_groups:  # within a dp group, shard pieces × replica groups form a grid
            mine_p = [p for p in pieces if set(p) <= set(g)]
            mine_r = [q for q in replicas if set(q) <= set(g)]
            assert sorted(r for p in mine_p for r in p) == g
            assert sorted(r for q in mine_r for r in q) == g
            assert all(len(set(p) & set(q)) == 1 for p in mine_p for q in mine_r), (
                level,
                mine_p,
                mine_r,
            )
            for (
                q
            ) in mine_r:  # a replica group has one member per unit, at the same position in each
                assert len(
                    {tuple(layout.level_groups(level)[r // layout.level_size(level)]) for r in q}
                ) == len(q)
                assert len({next(p for p in mine_p if r in p).index(r) for r in q}) == 1
    # the levels ZeRO cares about, spelled out
    assert layout.level_groups("global", within_dp=True) == dp_groups
    assert layout.level_groups("none", within_dp=True) == [[r] for g in dp_groups for r in g]
    assert sorted(layout.replica_groups("none")) == sorted(dp_groups)


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg", HW_LAYOUTS, ids=HW_IDS)
def test_nested_chunks_lie_inside_the_finer_levels_chunks(tp, pp, dp, rpn, rpg):
    """ZeRO's ownership: at every level the chunks of a dp group's ranks cover the buffer (each
    chunk held by the same number of ranks: its copies in other units), and a rank's chunk at a
    coarser level lies inside its chunk at each finer level — so the optimizer shard is always
    inside the gradients and parameters the rank holds."""
    layout = hw_layout(tp, pp, dp, rpn, rpg)
    chain = ["none", "gpu", "node", "global"]
    for group in layout.group_ranks("dp"):
        for level in chain:
            chunks = [layout.nested_chunk(r, level) for r in group]
            count = chunks[0][1]
            assert {c for _, c in chunks} == {count} and dp % count == 0
            held = [i for i, _ in chunks]
            assert sorted(set(held)) == list(range(count)) and all(
                held.count(i) == dp // count for i in held
            )
        for r in group:
            for fine, coarse in zip(chain, chain[1:]):
                (i, n), (j, m) = layout.nested_chunk(r, fine), layout.nested_chunk(r, coarse)
                assert i * (m // n) <= j < (i + 1) * (m // n), (r, fine, coarse)  # [j/m] ⊂ [i/n]
    # the digit groups between adjacent levels partition the world, and (none, L) is L's shard group
    for inner, outer in zip(chain, chain[1:]):
        assert _is_partition(layout.digit_groups(inner, outer), layout.world_size)
        assert sorted(layout.digit_groups("none", outer)) == sorted(
            layout.level_groups(outer, within_dp=True)
        )


def test_frontier_example():
    """Frontier: 8 ranks per node, 2 per MI250X. tp=2 on a GCD pair, dp across the rest."""
    layout = hw_layout(2, 1, 8, 8, 2)
    assert layout.level_groups("gpu")[:2] == [[0, 1], [2, 3]]
    assert layout.level_groups("node") == [list(range(8)), list(range(8, 16))]
    assert layout.group_ranks("dp")[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert layout.level_groups("node", within_dp=True)[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert layout.replica_groups("node")[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    assert layout.level_groups("gpu", within_dp=True)[:2] == [[0], [2]]  # tp uses the GCD pair
    assert layout.hardware_coords(11) == {"node": 1, "gpu": 1, "gcd": 1}


def test_without_hardware_description_the_world_is_one_node():
    layout = Layout(tp=2, pp=2, dp=2)
    assert layout.node_size == 8 and layout.level_groups("node") == [list(range(8))]
    assert layout.level_groups("gpu") == [[r] for r in range(8)]
    assert layout.level_groups("node", within_dp=True) == layout.group_ranks("dp")
    assert all(layout.hardware_coords(r) == {"node": 0, "gpu": r, "gcd": 0} for r in range(8))


def test_uneven_level_has_no_replica_groups():
    # a pipeline stage of tp·dp = 6 ranks on nodes of 4: node 0 holds dp ranks 0,1 of stage 0's dp
    # groups and node 1 holds only dp rank 2 of them
    layout = hw_layout(2, 2, 3, 4, 1)
    assert sorted(map(len, layout.level_groups("node", within_dp=True))) == [1] * 4 + [2] * 4
    with pytest.raises(ConfigError, match=r"within each node.*pieces of \[1, 2\] ranks.*tp·dp = 6"):
        layout.replica_groups("node")
    assert "dp_node_replica" not in _expected_groups(layout)[0]
    assert layout.replica_groups("global") == [[r] for g in layout.group_ranks("dp") for r in g]


def test_layout_rejects_impossible_hardware_and_unknown_levels():
    with pytest.raises(ValueError, match="ranks_per_node"):
        Layout(dp=6, ranks_per_node=4)
    with pytest.raises(ValueError, match="ranks_per_gpu"):
        Layout(dp=6, ranks_per_node=3, ranks_per_gpu=2)
    with pytest.raises(ValueError, match="unknown hierarchy level 'rack'"):
        Layout(dp=2).level_groups("rack")


def test_topology_level_group_lookup():
    topo = Topology(
        Layout(dp=4, ranks_per_node=2), 2, {"dp_node": "shard", "dp_node_replica": "replica"}
    )
    assert topo.hardware_coords == {"node": 1, "gpu": 0, "gcd": 0}
    assert topo.level_group("node", within_dp=True) == "shard"
    assert topo.level_group("node", replica=True) == "replica"
    assert topo.level_group("gpu") is None  # a single-rank group: collectives are no-ops
    with pytest.raises(ValueError, match="unknown hierarchy level"):
        topo.level_group("socket")


# ---------------------------------------------------------------------------------------------
# layout_from_config: every user mistake is a ConfigError naming key, value and fix
# ---------------------------------------------------------------------------------------------


def test_layout_from_config_valid():
    par = ParallelConfig(tp=2, pp=2, ranks_per_node=4, ranks_per_gpu=2)
    assert layout_from_config(par, 16, None) == Layout(
        tp=2, pp=2, dp=4, ranks_per_node=4, ranks_per_gpu=2
    )
    # ranks_per_node null: the launcher's LOCAL_WORLD_SIZE; without a launcher, one node
    assert layout_from_config(ParallelConfig(tp=2), 8, 4).ranks_per_node == 4
    assert layout_from_config(ParallelConfig(tp=2), 8, None).ranks_per_node == 8
    # a set ranks_per_node wins (one machine standing in for two nodes)
    assert layout_from_config(ParallelConfig(ranks_per_node=2), 4, 4).ranks_per_node == 2
    # tp spanning whole nodes is allowed; explicit dp that fits is kept
    assert layout_from_config(ParallelConfig(tp=8, dp=2), 16, 4) == Layout(
        tp=8, dp=2, ranks_per_node=4
    )


@pytest.mark.parametrize(
    "par,world,local,expected",
    [
        (
            dict(tp=2, pp=2, dp=3),
            8,
            None,
            [r"tp·pp·dp = 2·2·3 = 12 but the world size is 8; set parallel.dp=2"],
        ),
        (dict(tp=2, pp=3), 8, None, [r"world size 8 is not divisible by parallel.tp·pp = 2·3 = 6"]),
        (
            dict(ranks_per_node=3),
            8,
            None,
            [r"world size 8 is not a multiple of parallel.ranks_per_node=3.*divisor of 8"],
        ),
        (
            dict(),
            8,
            3,
            [
                r"world size 8 is not a multiple of parallel.ranks_per_node \(null: the launcher's "
                r"LOCAL_WORLD_SIZE=3\)"
            ],
        ),
        (
            dict(ranks_per_node=4, ranks_per_gpu=3),
            8,
            None,
            [
                r"parallel.ranks_per_gpu=3 must divide "
                r"parallel.ranks_per_node=4"
            ],
        ),
        (
            dict(tp=4),
            24,
            6,
            [
                r"parallel.tp=4 would straddle node boundaries.*LOCAL_WORLD_SIZE=6\), tp must divide it "
                r"\(1, 2, 3, 6\) or be a multiple of it"
            ],
        ),
        (
            dict(tp=4, pp=2, dp=3, ranks_per_node=6, ranks_per_gpu=4),
            20,
            8,
            [
                r"not divisible by parallel.tp·pp",
                r"not a multiple of parallel.ranks_per_node=6",
                r"ranks_per_gpu=4 must divide",
                r"parallel.tp=4 would straddle",
            ],
        ),
    ],
    ids=[
        "product",
        "tp-pp-divide",
        "per-node",
        "local-world",
        "per-gpu",
        "tp-straddles",
        "all-at-once",
    ],
)
def test_layout_from_config_errors(par, world, local, expected):
    with pytest.raises(ConfigError) as err:
        layout_from_config(ParallelConfig(**par), world, local)
    problems = err.value.problems
    assert len(problems) == len(expected), problems
    for pattern, problem in zip(expected, problems):
        assert __import__("re").search(pattern, problem), (pattern, problem)


# ---------------------------------------------------------------------------------------------
# build_topology in a real gloo world: creation order agrees on every rank, groups communicate.
# Megatron's reference and the fake worlds run in a child process (this file run as a script,
# `mode` picks the body).
# ---------------------------------------------------------------------------------------------


def _run_child(mode: str, layouts: list) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )  # worlds
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode, json.dumps(layouts)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _real_world_worker(rank: int, world: int, port: int, out_dir: str, layout: Layout) -> None:
    join_world(rank, world, port, timeout_s=30)
    try:
        topo = build_topology(layout, rank)
        sums = {}
        for name in sorted(
            topo.groups
        ):  # same order everywhere: a mismatched group would hang or mis-sum
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=topo.groups[name])
            sums[name] = (dist.get_process_group_ranks(topo.groups[name]), t.item())
        torch.save(sums, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


REAL_WORLDS = [
    (1, 1, 4, 2, 2),
    (2, 1, 4, 4, 2),
]  # 4 ranks: units coincide; 8 ranks: tp on a GCD pair


@pytest.mark.slow  # real gloo worlds of 4 and 8 ranks
def test_build_topology_real_gloo_world(tmp_path):
    for key in REAL_WORLDS:
        layout, out = hw_layout(*key), tmp_path / "-".join(map(str, key))
        out.mkdir()
        built = run_world(_real_world_worker, layout.world_size, out, layout)
        expected = _expected_groups(layout)
        for r, got in enumerate(built):
            assert set(got) == set(expected[r]), (key, r, sorted(got), sorted(expected[r]))
            for name, (members, total) in got.items():
                assert members == expected[r][name], (key, r, name)
                assert total == sum(members), (key, r, name, total)  # the group really communicates
    small, frontier = (_expected_groups(hw_layout(*k)) for k in REAL_WORLDS)
    assert small[0]["node"] == small[0]["gpu"] == [0, 1] and small[0]["dp_node_replica"] == [0, 2]
    assert frontier[2]["dp_node"] == [0, 2] and frontier[2]["dp_node_replica"] == [2, 6]
    assert frontier[5]["gpu"] == [4, 5] and frontier[5]["node"] == [4, 5, 6, 7]


def _expected_groups(layout: Grid) -> list[dict[str, list[int]]]:
    """Per rank, the groups build_topology should keep, from the grid's public methods: every
    parallel dimension's, each hierarchy level's unit / data-dimension shard / replica group and each
    digit group where it has more than one member (none for a level that cuts the data groups
    unevenly); an expert layout's expert-parallel groups cut by node where they span nodes."""
    data = layout.data_dim
    named = [(dim, layout.group_ranks(dim)) for dim in layout.DIMS]
    for level in LEVELS:
        named += [
            (level_key(level, data=data), layout.level_groups(level)),
            (
                level_key(level, within_dp=True, data=data),
                layout.level_groups(level, within_dp=True),
            ),
        ]
        try:
            named.append((level_key(level, replica=True, data=data), layout.replica_groups(level)))
        except ConfigError:
            pass
    for i, inner in enumerate(CHAIN):  # ZeRO's digit groups between any two partition levels
        for outer in CHAIN[i + 1 :]:
            try:
                named.append((digit_key(inner, outer, data), layout.digit_groups(inner, outer)))
            except ConfigError:
                pass
    named.append(
        ("pp_ends", layout.pipeline_end_ranks())
    )  # only the pipelines' end ranks are members
    if isinstance(layout, ExpertLayout):
        split = layout.node_split("ep")  # ep groups spanning nodes: their pieces and columns
        if split is not None:
            named += [("ep_in_node", split[0]), ("ep_across_nodes", split[1])]
    out = []
    for r in range(layout.world_size):
        mine = {}
        for name, groups in named:
            g = next((g for g in groups if r in g), None)
            if g is not None and (name in layout.DIMS or len(g) > 1):
                mine[name] = g
        out.append(mine)
    return out


# ---------------------------------------------------------------------------------------------
# Reference: megatron-core parallel_state in a fake world, one child process for all layouts
# ---------------------------------------------------------------------------------------------


def _megatron_reference(layouts: list[tuple[int, int, int]]) -> dict:
    """Child-process body: for each layout and rank, megatron's groups and ranks, plus the groups
    our build_topology creates in the same world."""
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from strata.parallel.topology import build_topology

    members = dist.get_process_group_ranks
    out = {}
    for tp, pp, dp in layouts:
        n = tp * pp * dp
        per_rank = []
        for r in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
            try:
                ps.initialize_model_parallel(
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    create_gloo_process_groups=False,
                )
                assert ps.get_data_parallel_world_size() == dp
                mg = {
                    "groups": {
                        "tp": members(ps.get_tensor_model_parallel_group()),
                        "pp": members(ps.get_pipeline_model_parallel_group()),
                        "dp": members(ps.get_data_parallel_group()),
                    },
                    "coords": {
                        "tp": ps.get_tensor_model_parallel_rank(),
                        "pp": ps.get_pipeline_model_parallel_rank(),
                        "dp": ps.get_data_parallel_rank(),
                    },
                }
                topo = build_topology(Layout(tp=tp, pp=pp, dp=dp), r)
                ours = {dim: members(g) for dim, g in topo.groups.items()}
                per_rank.append({"megatron": mg, "build_topology": ours})
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
        out[f"{tp},{pp},{dp}"] = per_rank
    return out


@pytest.fixture(scope="module")
def megatron_reference() -> dict:
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip(
            "megatron-core not installed (pip install -e '.[test]' installs megatron-core==0.16.1)"
        )
    return _run_child("megatron", LAYOUTS)


@pytest.mark.slow  # megatron-core's groups, built in a child process
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=IDS)
def test_membership_and_coords_match_megatron(megatron_reference, tp, pp, dp):
    layout = layout_of(tp, pp, dp)
    per_rank = megatron_reference[f"{tp},{pp},{dp}"]
    assert len(per_rank) == layout.world_size
    ours_all = {dim: layout.group_ranks(dim) for dim in DIMS}
    theirs_all = {dim: set() for dim in DIMS}
    for r, rec in enumerate(per_rank):
        mg = rec["megatron"]
        assert layout.coords(r) == mg["coords"], (
            f"rank {r}: ours {layout.coords(r)} megatron {mg['coords']}"
        )
        for dim in DIMS:
            mine = [g for g in ours_all[dim] if r in g]
            assert len(mine) == 1, (dim, r, ours_all[dim])
            assert mine[0] == mg["groups"][dim], (
                f"rank {r} {dim}: ours {mine[0]} megatron {mg['groups'][dim]}"
            )
            # rank within the group = coordinate along that dimension, in both
            assert mine[0].index(r) == mg["coords"][dim]
            theirs_all[dim].add(tuple(mg["groups"][dim]))
    for dim in DIMS:  # the full set of groups, not just each rank's own
        assert {tuple(g) for g in ours_all[dim]} == theirs_all[dim], dim


@pytest.mark.slow  # megatron-core's groups, built in a child process
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=IDS)
def test_build_topology_groups_match_megatron(megatron_reference, tp, pp, dp):
    """The process groups build_topology actually creates (not just the rank arithmetic)."""
    for r, rec in enumerate(megatron_reference[f"{tp},{pp},{dp}"]):
        built, mg = rec["build_topology"], rec["megatron"]["groups"]
        for dim in DIMS:
            assert built[dim] == mg[dim], (
                f"rank {r} {dim}: build_topology {built[dim]} megatron {mg[dim]}"
            )
        # without a hardware description the world is one node: its level groups are the world
        # (and dp for the within-dp cuts), all reused, never new groups
        assert built == _expected_groups(layout_of(tp, pp, dp))[r], f"rank {r}: {sorted(built)}"


# ---------------------------------------------------------------------------------------------
# build_topology's hierarchy groups for every hardware layout, in fake worlds (child process)
# ---------------------------------------------------------------------------------------------

UNEVEN = (2, 2, 3, 4, 1)  # pipeline stages of 6 ranks on nodes of 4: no node replica groups


def _fake_world_builds(layouts: list[tuple[int, int, int, int, int]]) -> dict:
    """Child-process body: for each layout and rank, the groups build_topology keeps."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for key in layouts:
        layout = hw_layout(*key)
        per_rank = []
        for r in range(layout.world_size):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=layout.world_size)
            try:
                topo = build_topology(layout, r)
                per_rank.append(
                    {name: dist.get_process_group_ranks(g) for name, g in topo.groups.items()}
                )
            finally:
                dist.destroy_process_group()
        out[",".join(map(str, key))] = per_rank
    return out


@pytest.fixture(scope="module")
def fake_world_builds() -> dict:
    return _run_child("hardware", HW_LAYOUTS + [UNEVEN])


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg", HW_LAYOUTS + [UNEVEN], ids=HW_IDS + ["uneven"])
def test_build_topology_hierarchy_groups(fake_world_builds, tp, pp, dp, rpn, rpg):
    layout = hw_layout(tp, pp, dp, rpn, rpg)
    expected = _expected_groups(layout)
    for r, built in enumerate(fake_world_builds[f"{tp},{pp},{dp},{rpn},{rpg}"]):
        assert built == expected[r], f"rank {r}: built {built} expected {expected[r]}"
        for level in ("gpu", "node"):  # a rank's unit group is its hardware unit
            if layout.level_size(level) > 1:
                assert r in built[level_key(level)]
                assert {layout.hardware_coords(x)["node"] for x in built[level_key(level)]} == {
                    layout.hardware_coords(r)["node"]
                }
    if (tp, pp, dp, rpn, rpg) == UNEVEN:
        assert all("dp_node_replica" not in b for b in fake_world_builds["2,2,3,4,1"])


def test_an_expert_parallel_group_spanning_nodes_is_cut_into_node_pieces_and_columns():
    """What the hierarchical expert dispatch sends over: 8 ranks on 2 nodes of 4, as pieces inside
    each node and columns across them; none where a group stays inside a node or is cut unevenly."""
    spanning = expert_layout(Layout(dp=16, ranks_per_node=4), 8)
    pieces, columns = spanning.node_split("ep")
    assert pieces == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert columns == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert spanning.node_span("ep") == (4, 2)
    inside = ExpertLayout(ep=4, edp=2, ranks_per_node=4)
    assert inside.node_split("ep") is None and inside.node_span("ep") == (4, 1)
    assert ExpertLayout(ep=6, edp=2, ranks_per_node=4).node_split("ep") is None  # pieces of 4 and 2


# (tp, pp, dp, ranks_per_node, ranks_per_gpu, ep)
EXPERT_LAYOUTS = [
    (1, 1, 8, 4, 1, 2),
    (1, 1, 8, 2, 1, 4),
    (2, 1, 4, 4, 2, 8),
    (2, 2, 4, 8, 2, 4),
    (1, 2, 6, 4, 1, 3),
    (1, 1, 16, 4, 2, 8),
    (1, 1, 24, 8, 1, 6),  # edp groups cut unevenly by the nodes: no node-level partitioning
    (2, 1, 4, 8, 1, 1),  # the routers' domain under tensor parallelism
]
EXPERT_IDS = [f"tp{a}-pp{b}-dp{c}-rpn{d}-rpg{e}-ep{f}" for a, b, c, d, e, f in EXPERT_LAYOUTS]


@pytest.mark.parametrize("tp,pp,dp,rpn,rpg,ep", EXPERT_LAYOUTS, ids=EXPERT_IDS)
def test_the_expert_layout_folds_ep_and_edp_into_each_stage(tp, pp, dp, rpn, rpg, ep):
    """Megatron-core's MoE parallel folding: a stage's tp·dp ranks as ep consecutive ranks (the
    expert-parallel group) times edp, on the dense layout's hardware and pipeline."""
    dense = hw_layout(tp, pp, dp, rpn, rpg)
    layout = expert_layout(dense, ep)
    assert layout.DIMS == EXPERT_DIMS and layout.data_dim == "edp"
    assert (layout.ep, layout.edp, layout.pp) == (ep, tp * dp // ep, pp)
    assert layout.world_size == dense.world_size and layout.node_size == dense.node_size
    n = layout.world_size
    assert layout.group_ranks("ep") == [list(range(s, s + ep)) for s in range(0, n, ep)]
    assert layout.group_ranks("pp") == dense.group_ranks("pp")
    for r in range(n):
        c = layout.coords(r)
        assert set(c) == set(EXPERT_DIMS) and layout.rank_of(**c) == r
        assert c["pp"] == dense.coords(r)["pp"]
        edp = next(g for g in layout.group_ranks("edp") if r in g)
        assert edp == [q for q in range(n) if q % ep == r % ep and q // (tp * dp) == c["pp"]]
    with pytest.raises(ValueError, match="no dimension 'tp'"):
        layout.group_ranks("tp")
    for r in range(n):  # ZeRO's chunks over edp nest as they do over dp
        for fine, coarse in zip(CHAIN, CHAIN[1:]):
            try:
                (i, a), (j, b) = layout.nested_chunk(r, fine), layout.nested_chunk(r, coarse)
            except ConfigError as e:
                assert "expert-data-parallel group" in str(e) and "parallel.ep=" in str(e)
                break
            assert i * (b // a) <= j < (i + 1) * (b // a)


def test_an_uneven_expert_data_parallel_cut_names_ep():
    layout = expert_layout(Layout(dp=24, ranks_per_node=8), 6)
    with pytest.raises(
        ConfigError, match=r"parallel.ep=6, pp=1 \(edp=4\).*edp group \[0, 6, 12, 18\]"
    ):
        layout.replica_groups("node")


@pytest.mark.parametrize("per_node", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("ep", [1, 2, 3, 4, 6, 8, 12, 16, 24])
def test_the_config_refuses_a_hierarchical_dispatch_exactly_where_there_is_no_node_split(
    ep, per_node
):
    """strata.config.vocabulary.ep_dispatch_problem, which the config's checks run before anything
    starts, decides from the node size alone what the topology finds by cutting every group."""
    world = 48
    layout = ExpertLayout(ep=ep, edp=world // ep, ranks_per_node=per_node)
    problem = ep_dispatch_problem(ep, "hierarchical", per_node, "the test's nodes")
    spans = layout.node_split("ep") is not None
    assert (problem is None) == (ep == 1 or spans), problem  # ep = 1: no dispatch to refuse
    assert ep_dispatch_problem(ep, "flat", per_node, "") is None
    assert ep_dispatch_problem(ep, "auto", per_node, "") is None


def test_expert_topology_groups_are_named_ep_and_edp():
    topo = ExpertTopology(
        expert_layout(Layout(dp=8, ranks_per_node=4), 2), 5, {"edp_node": "shard", "ep": "ep"}
    )
    assert topo.coords == {"pp": 0, "edp": 2, "ep": 1}
    assert topo.group("ep") == "ep" and topo.level_group("node", within_dp=True) == "shard"
    assert ExpertTopology(ExpertLayout(ep=1, edp=4), 0, {"ep": "x"}).group("ep") is None


def _expert_world_builds(layouts: list[tuple[int, int, int, int, int, int]]) -> dict:
    """Child-process body: for each layout and rank, the groups the experts' topology keeps when
    built after the dense one (reusing its groups), and how many groups it made anew."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for *key, ep in layouts:
        dense = hw_layout(*key)
        per_rank = []
        for r in range(dense.world_size):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=dense.world_size)
            try:
                topo = build_topology(dense, r)
                experts = build_topology(expert_layout(dense, ep), r, reuse=topo)
                per_rank.append(
                    {
                        "groups": {
                            name: dist.get_process_group_ranks(g)
                            for name, g in experts.groups.items()
                        },
                        "new": len(experts.made) - len(topo.made),
                        "reused": sorted(
                            name
                            for name, g in experts.groups.items()
                            if any(g is h for h in topo.made.values())
                        ),
                    }
                )
            finally:
                dist.destroy_process_group()
        out[",".join(map(str, (*key, ep)))] = per_rank
    return out


def test_build_topology_expert_groups():
    """The experts' topology keeps its groups under their own names, and makes a group only for a
    membership the dense topology did not already make (each would be one more communicator)."""
    builds = _run_child("experts", EXPERT_LAYOUTS)
    for *key, ep in EXPERT_LAYOUTS:
        dense = hw_layout(*key)
        layout = expert_layout(dense, ep)
        expected = _expected_groups(layout)
        made_by_dense = {
            tuple(g) for groups in _expected_groups(dense) for g in groups.values()
        } | {tuple(range(dense.world_size))}
        wanted = {tuple(g) for groups in expected for g in groups.values() if len(g) > 1}
        for r, built in enumerate(builds[",".join(map(str, (*key, ep)))]):
            assert built["groups"] == expected[r], (key, ep, r)
            assert built["new"] == len(wanted - made_by_dense), (key, ep, r)
            assert all(tuple(built["groups"][name]) in made_by_dense for name in built["reused"])
        assert ("ep_in_node" in expected[0]) == (layout.node_split("ep") is not None)
    assert "ep_across_nodes" in _expected_groups(expert_layout(hw_layout(1, 1, 8, 2, 1), 4))[0]


EP_LAYOUTS = [(1, 1, 4, 2), (1, 1, 8, 4), (2, 1, 4, 4), (2, 2, 2, 2), (1, 2, 4, 4), (2, 1, 2, 1)]
# tp, pp, dp, ep


def _megatron_experts(layouts: list[tuple[int, int, int, int]]) -> dict:
    """Child-process body: megatron's expert-model-parallel and expert-data-parallel groups and
    ranks (experts not tensor-parallel: expert_tensor_parallel_size=1, the folding Strata runs)."""
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    members = dist.get_process_group_ranks
    out = {}
    for tp, pp, dp, ep in layouts:
        n = tp * pp * dp
        per_rank = []
        for r in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
            try:
                ps.initialize_model_parallel(
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=1,
                    create_gloo_process_groups=False,
                )
                per_rank.append(
                    {
                        "ep": members(ps.get_expert_model_parallel_group()),
                        "edp": members(ps.get_expert_data_parallel_group()),
                        "coords": {
                            "ep": ps.get_expert_model_parallel_rank(),
                            "edp": ps.get_expert_data_parallel_rank(),
                        },
                    }
                )
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
        out[",".join(map(str, (tp, pp, dp, ep)))] = per_rank
    return out


@pytest.mark.slow  # megatron-core's groups, built in a child process
def test_expert_groups_match_megatron():
    """ExpertLayout's ep and edp groups are megatron-core's expert-model-parallel and
    expert-data-parallel groups (MoE parallel folding with untensor-parallel experts)."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip(
            "megatron-core not installed (pip install -e '.[test]' installs megatron-core==0.16.1)"
        )
    reference = _run_child("megatron-ep", EP_LAYOUTS)
    for tp, pp, dp, ep in EP_LAYOUTS:
        layout = expert_layout(Layout(tp=tp, pp=pp, dp=dp), ep)
        for r, mg in enumerate(reference[f"{tp},{pp},{dp},{ep}"]):
            for dim in ("ep", "edp"):
                assert next(g for g in layout.group_ranks(dim) if r in g) == mg[dim], (
                    (tp, pp, dp, ep),
                    r,
                    dim,
                )
                assert layout.coords(r)[dim] == mg["coords"][dim]


# ---------------------------------------------------------------------------------------------
# Context parallelism: carved out of dp, innermost after tp, against megatron-core's groups
# ---------------------------------------------------------------------------------------------

CP_LAYOUTS = [
    (1, 1, 2, 1),
    (1, 1, 2, 2),
    (2, 1, 2, 2),
    (2, 2, 2, 1),
    (1, 2, 4, 1),
    (2, 1, 4, 1),
]  # tp, pp, cp, dp


def _megatron_context(layouts: list[tuple[int, int, int, int]]) -> dict:
    """Child-process body: megatron's context-parallel group, its data-parallel group without and with
    the context-parallel ranks, for every rank of each (tp, pp, cp, dp) layout."""
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    members = dist.get_process_group_ranks
    out = {}
    for tp, pp, cp, dp in layouts:
        n = tp * pp * cp * dp
        per_rank = []
        for r in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
            try:
                ps.initialize_model_parallel(
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    context_parallel_size=cp,
                    create_gloo_process_groups=False,
                )
                per_rank.append(
                    {
                        "cp": list(ps.get_context_parallel_global_ranks()),
                        "cp_rank": ps.get_context_parallel_rank(),
                        "dp": members(ps.get_data_parallel_group()),
                        "dp_cp": members(ps.get_data_parallel_group(with_context_parallel=True)),
                    }
                )
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
        out[",".join(map(str, (tp, pp, cp, dp)))] = per_rank
    return out


@pytest.mark.slow  # megatron-core's groups, built in a child process
def test_context_parallel_groups_match_megatron():
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip(
            "megatron-core not installed (pip install -e '.[test]' installs megatron-core==0.16.1)"
        )
    reference = _run_child("megatron-cp", CP_LAYOUTS)
    for tp, pp, cp, dp in CP_LAYOUTS:
        layout = Layout(tp=tp, pp=pp, dp=dp * cp, cp=cp)
        assert layout.data_parallel == dp
        for r, mg in enumerate(reference[f"{tp},{pp},{cp},{dp}"]):
            topo = Topology(layout, r)
            assert next(g for g in layout.context_groups() if r in g) == mg["cp"], (
                tp,
                pp,
                cp,
                dp,
                r,
            )
            assert topo.cp_rank == mg["cp_rank"]
            ours_dp = next(g for g in layout.group_ranks("dp") if r in g)
            assert (
                ours_dp == mg["dp_cp"]
            )  # gradients and ZeRO partitions span dp·cp, as megatron reduces them
            assert [q for q in ours_dp if Topology(layout, q).cp_rank == topo.cp_rank] == mg["dp"]
            assert topo.data_size == dp and mg["dp"].index(r) == topo.data_rank


if __name__ == "__main__":  # child process of the megatron_reference / fake_world_builds fixtures
    mode, arg = sys.argv[1], [tuple(x) for x in json.loads(sys.argv[2])]
    body = {
        "megatron": _megatron_reference,
        "hardware": _fake_world_builds,
        "megatron-cp": _megatron_context,
        "experts": _expert_world_builds,
        "megatron-ep": _megatron_experts,
    }[mode]
    print(json.dumps(body(arg)))
