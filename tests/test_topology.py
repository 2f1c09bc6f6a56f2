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

import pytest

from parallel.topology import DIMS, Layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (tp, pp, dp)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 4, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 1),
           (2, 4, 1), (4, 1, 2), (1, 2, 4), (2, 1, 4), (3, 2, 2), (2, 3, 2)]
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
        for g in groups:  # a group is the ranks that differ only in `dim`, ordered by that coordinate
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
                assert layout.coords(layout.rank_of(pp=p, dp=d, tp=t)) == {"pp": p, "dp": d, "tp": t}


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
# Reference: megatron-core parallel_state in a fake world, one child process for all layouts
# ---------------------------------------------------------------------------------------------

def _megatron_reference(layouts: list[tuple[int, int, int]]) -> dict:
    """Child-process body: for each layout and rank, megatron's groups and ranks, plus the groups
    our build_topology creates in the same world."""
    import warnings
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state as ps

    from parallel.topology import build_topology

    members = dist.get_process_group_ranks
    out = {}
    for tp, pp, dp in layouts:
        n = tp * pp * dp
        per_rank = []
        for r in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
            try:
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             create_gloo_process_groups=False)
                assert ps.get_data_parallel_world_size() == dp
                mg = {
                    "groups": {"tp": members(ps.get_tensor_model_parallel_group()),
                               "pp": members(ps.get_pipeline_model_parallel_group()),
                               "dp": members(ps.get_data_parallel_group())},
                    "coords": {"tp": ps.get_tensor_model_parallel_rank(),
                               "pp": ps.get_pipeline_model_parallel_rank(),
                               "dp": ps.get_data_parallel_rank()},
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
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core not installed (pip install -e '.[test]' installs megatron-core==0.16.1)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(LAYOUTS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=IDS)
def test_membership_and_coords_match_megatron(megatron_reference, tp, pp, dp):
    layout = layout_of(tp, pp, dp)
    per_rank = megatron_reference[f"{tp},{pp},{dp}"]
    assert len(per_rank) == layout.world_size
    ours_all = {dim: layout.group_ranks(dim) for dim in DIMS}
    theirs_all = {dim: set() for dim in DIMS}
    for r, rec in enumerate(per_rank):
        mg = rec["megatron"]
        assert layout.coords(r) == mg["coords"], f"rank {r}: ours {layout.coords(r)} megatron {mg['coords']}"
        for dim in DIMS:
            mine = [g for g in ours_all[dim] if r in g]
            assert len(mine) == 1, (dim, r, ours_all[dim])
            assert mine[0] == mg["groups"][dim], f"rank {r} {dim}: ours {mine[0]} megatron {mg['groups'][dim]}"
            # rank within the group = coordinate along that dimension, in both
            assert mine[0].index(r) == mg["coords"][dim]
            theirs_all[dim].add(tuple(mg["groups"][dim]))
    for dim in DIMS:  # the full set of groups, not just each rank's own
        assert {tuple(g) for g in ours_all[dim]} == theirs_all[dim], dim


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=IDS)
def test_build_topology_groups_match_megatron(megatron_reference, tp, pp, dp):
    """The process groups build_topology actually creates (not just the rank arithmetic)."""
    for r, rec in enumerate(megatron_reference[f"{tp},{pp},{dp}"]):
        built, mg = rec["build_topology"], rec["megatron"]["groups"]
        assert set(built) == set(DIMS), f"rank {r}: build_topology made groups for {sorted(built)}"
        for dim in DIMS:
            assert built[dim] == mg[dim], f"rank {r} {dim}: build_topology {built[dim]} megatron {mg[dim]}"


if __name__ == "__main__":  # child process of the megatron_reference fixture
    print(json.dumps(_megatron_reference([tuple(x) for x in json.loads(sys.argv[1])])))
