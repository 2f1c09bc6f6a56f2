"""The expert dispatches across ranks against one process: 4 ranks on 2 nodes of 2, one MoE layer's 8
experts split 2 per rank, each rank routing its own tokens. The flat all-to-all and the hierarchical
dispatch (one copy per destination node, fanned out inside the node) must give the layer's output
and every gradient (tokens, gates through the router, experts) of the whole layer run in one process
on all the tokens, and put exactly the bytes on the inter-node link that the routing implies: one
row per (token, expert on the other node) for the flat exchange, one per (token, other node touched)
for the hierarchical one — with node-limited routing (2 groups = the nodes, M = 1) at most one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from strata.config import ModelConfig, MoEConfig
from strata.errors import ConfigError
from strata.moe import Experts, MoE
from strata.parallel import comm
from strata.parallel.experts import AllToAllDispatch, make_dispatch
from strata.parallel.topology import ExpertLayout, ExpertTopology, build_topology

from worlds import join_world, run_world

pytestmark = pytest.mark.slow  # a 4-process gloo world

WORLD, PER_NODE, EXPERTS, TOP_K, D, TOKENS = 4, 2, 8, 3, 16, 24
ROUTINGS = {"free": {}, "node-limited": {"route_groups": 2, "route_group_limit": 1}}


def make_layer(routing: dict) -> MoE:
    cfg = ModelConfig(
        n_layers=1,
        d_model=D,
        n_heads=2,
        seq_len=8,
        moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_ffn=8, router="sigmoid", **routing),
    )
    torch.manual_seed(0)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens and the gradient arriving at the layer's output, rank by rank."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(WORLD * TOKENS, D, generator=g), torch.randn(WORLD * TOKENS, D, generator=g)


def run(
    layer: MoE,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    dispatch=None,
    experts: Experts | None = None,
) -> dict:
    x = x.clone().requires_grad_()
    routing = layer.router(x)
    out = (dispatch or layer.dispatch)(x, routing, experts or layer.experts)
    out.backward(grad_out)
    ex = experts or layer.experts
    return {
        "out": out.detach(),
        "x": x.grad,
        "router": layer.router.weight.grad.clone(),
        "experts": {n: p.grad.clone() for n, p in ex.named_parameters()},
        "experts_chosen": routing.experts,
    }


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    join_world(rank, size, port)
    try:
        topo = build_topology(ExpertLayout(ep=WORLD, ranks_per_node=PER_NODE), rank)
        x, grad_out = (t[rank * TOKENS : (rank + 1) * TOKENS] for t in inputs())
        per_rank = EXPERTS // WORLD
        results = {}
        for name, routing in ROUTINGS.items():
            for kind in ("flat", "hierarchical"):
                layer = make_layer(routing)
                mine = Experts(per_rank, D, 8)
                with torch.no_grad():
                    for n, p in mine.named_parameters():
                        p.copy_(getattr(layer.experts, n)[rank * per_rank : (rank + 1) * per_rank])
                dispatch = make_dispatch(topo, WORLD, EXPERTS, kind)
                dist.barrier()
                before = comm.bytes_by_link["inter-node"]
                got = run(layer, x, grad_out, dispatch, mine)
                got["inter_node_bytes"] = comm.bytes_by_link["inter-node"] - before
                got["dispatch"] = type(dispatch).__name__
                results[(name, kind)] = got
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("dispatch"), timeout_s=120)


@pytest.mark.parametrize("kind", ["flat", "hierarchical"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_dispatch_across_nodes_matches_one_process(ranks, routing, kind):
    x, grad_out = inputs()
    ref = run(make_layer(ROUTINGS[routing]), x, grad_out)
    got = [r[(routing, kind)] for r in ranks]
    assert (
        got[0]["dispatch"]
        == {"flat": "AllToAllDispatch", "hierarchical": "HierarchicalDispatch"}[kind]
    )
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.cat([g["out"] for g in got]), ref["out"], **close)
    torch.testing.assert_close(torch.cat([g["x"] for g in got]), ref["x"], **close)
    torch.testing.assert_close(sum(g["router"] for g in got), ref["router"], **close)
    for name, grad in ref["experts"].items():
        torch.testing.assert_close(torch.cat([g["experts"][name] for g in got]), grad, **close)

    # The bytes each rank sent across nodes, summed (a rank sends the results of the tokens it received).
    per_rank, per_node = EXPERTS // WORLD, EXPERTS // (WORLD // PER_NODE)
    want = 0
    for rank, g in enumerate(got):
        remote = (
            g["experts_chosen"] // per_node
        ) != rank // PER_NODE  # (tokens, k): slot on the other node
        if (
            kind == "flat"
        ):  # counts to the 2 remote ranks; rows there and back, forward and backward
            want += 2 * per_rank * 8 + 4 * int(remote.sum()) * D * 4
        else:  # the count to the remote node; per copy: rows and results both ways, gates both ways, ids
            want += 8 + int(remote.any(dim=1).sum()) * (4 * D * 4 + 3 * TOP_K * 4)
        if routing == "node-limited":
            assert all(len(set(row.tolist())) == 1 for row in g["experts_chosen"] // per_node)
    assert sum(g["inter_node_bytes"] for g in got) == want


def test_hierarchical_sends_fewer_bytes_across_nodes(ranks):
    for routing in ROUTINGS:
        flat = sum(r[(routing, "flat")]["inter_node_bytes"] for r in ranks)
        hier = sum(r[(routing, "hierarchical")]["inter_node_bytes"] for r in ranks)
        assert hier < flat, routing
    limited = sum(r[("node-limited", "hierarchical")]["inter_node_bytes"] for r in ranks)
    limited_flat = sum(r[("node-limited", "flat")]["inter_node_bytes"] for r in ranks)
    assert limited <= 0.6 * limited_flat


def test_make_dispatch_refuses_what_the_config_refuses():
    """A caller that skipped the config's checks meets the same rule, in the same words."""
    inside, uneven = (
        ExpertLayout(ep=4, ranks_per_node=4),
        ExpertLayout(ep=6, edp=2, ranks_per_node=4),
    )
    with pytest.raises(ConfigError, match=r"4 ranks per node, ranks 0\.\.3 lie on one node"):
        make_dispatch(ExpertTopology(inside, 0), 4, EXPERTS, "hierarchical")
    with pytest.raises(ConfigError, match=r"pieces of \[2, 4\] ranks"):
        make_dispatch(ExpertTopology(uneven, 0), 6, 12, "hierarchical")
    for layout in (inside, uneven):  # auto falls back to the flat all-to-all
        dispatch = make_dispatch(ExpertTopology(layout, 0), layout.ep, 12, "auto")
        assert isinstance(dispatch, AllToAllDispatch)
