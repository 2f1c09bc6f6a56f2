"""Expert parallelism (`parallel.ep`): each MoE layer's experts split over the expert-parallel group
(the "ep" groups of `parallel.topology.ExpertLayout`), and tokens exchanged with all-to-all so that
each rank runs only its own experts.

`apply_expert_parallel` keeps this rank's slice of every MoE layer's stacked expert weights (rows
[rank·E/ep, (rank+1)·E/ep) along dimension 0, with a `Placement`, so checkpoints hold and reshard
the whole (E, ·, ·) tensors) and marks them as expert parameters, which the ZeRO engine reduces over
the expert-data-parallel group instead of dp. `AllToAllDispatch` replaces the layer's local
dispatch: sort the token copies by expert (so by destination rank), exchange the counts, send the
tokens (`comm.all_to_all`, bytes counted per link level), run the local experts grouped by expert,
send the results back, and add them to their tokens weighted by the gates on the source rank (the
gate weights' gradient stays local). Both exchanges are autograd functions whose backward is the
reverse exchange, as Megatron-core's and torchtitan's all-to-all dispatchers do.

Where the expert-parallel group spans nodes, `HierarchicalDispatch` (parallel.ep_dispatch) sends
each token across the inter-node link once per destination node instead of once per expert there,
and fans it out inside the node; with node-limited routing (model.moe.route_groups = the nodes,
route_group_limit = M) a token then crosses the link at most M times each way.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.config.vocabulary import ep_dispatch_problem, experts_split_problem
from strata.errors import ConfigError
from strata.model import GPT, named_blocks
from strata.moe import Dispatch, MoE, Routing, sort_by_expert
from strata.parallel import comm
from strata.parallel.tensor import Placement, set_placement
from strata.parallel.topology import ExpertTopology

# The ZeRO engine reduces and partitions a parameter over its *domain*'s data-parallel ranks: ""
# (the default) the dp group; EXPERTS the edp groups of `expert_layout(layout, ep)`; ROUTING (the
# router and shared experts of MoE layers under tensor parallelism, which each tp rank trains on its
# own part of the sequence) all tp·dp ranks of the stage, the edp groups of `expert_layout(layout, 1)`.
EXPERTS, ROUTING = "experts", "routing"
_DOMAIN = "reduce_domain"  # the attribute a parameter carries its domain in


def domain_of(p: torch.Tensor) -> str:
    """The ranks `p`'s gradient is reduced over: "" (data parallel), EXPERTS or ROUTING."""
    return getattr(p, _DOMAIN, "")


class _Exchange(torch.autograd.Function):
    """`comm.all_to_all` forward; the reverse exchange (the gradients back to where their rows came
    from) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:  # type: ignore[override]
        """Rows of `x` to the ranks of `group`, `send[i]` of them to rank i, and `recv[j]` from
        each rank j in their place."""
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all(x, send, recv, group, dim="ep")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        """The rows' gradients back to the ranks they came from."""
        return comm.all_to_all(grad, ctx.recv, ctx.send, ctx.group, dim="ep"), None, None, None


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows received from S ranks come source by source, each source's rows expert by expert
    (`counts[s, e]` of them): the order of those rows grouped expert by expert instead."""
    flat = counts.flatten().tolist()
    starts, pos = [], 0
    for n in flat:
        starts.append(pos)
        pos += n
    sources, local = counts.shape
    pieces = [
        torch.arange(starts[s * local + e], starts[s * local + e] + flat[s * local + e])
        for e in range(local)
        for s in range(sources)
    ]
    return (
        torch.cat(pieces).to(counts.device)
        if pieces
        else torch.zeros(0, dtype=torch.long, device=counts.device)
    )


class AllToAllDispatch:
    """Tokens to the ranks of the expert-parallel `group` that hold their experts, and back."""

    def __init__(self, group, size: int, num_experts: int):
        self.group, self.size, self.num_experts = group, size, num_experts

    def __call__(self, x: torch.Tensor, routing: Routing, experts: nn.Module) -> torch.Tensor:
        k, local = routing.experts.shape[1], self.num_experts // self.size
        order, flat = sort_by_expert(routing.experts, routing.kept)
        per_expert = torch.bincount(flat[order], minlength=self.num_experts).view(self.size, local)
        counts = comm.all_to_all(per_expert, [1] * self.size, [1] * self.size, self.group, dim="ep")
        send, recv = per_expert.sum(dim=1).tolist(), counts.sum(dim=1).tolist()
        received = _Exchange.apply(x[order // k], send, recv, self.group)
        by_expert = expert_major(counts)
        done = experts(received[by_expert], counts.sum(dim=0))
        # back in arrival order
        returned = _Exchange.apply(done[by_expert.argsort()], recv, send, self.group)
        weights = routing.weights.flatten()[order].unsqueeze(1).to(returned.dtype)
        return x.new_zeros(x.shape, dtype=returned.dtype).index_add_(
            0, order // k, returned * weights
        )


class HierarchicalDispatch:
    """Tokens to their experts in two hops, for an expert-parallel group spanning `nodes` nodes:
    across the nodes, one copy of each token to every node that holds any of its experts (to the
    rank at this rank's position there, over `across`), with the experts it chose there and their
    gate weights; inside the node, from that rank to the experts' ranks (an `AllToAllDispatch` over
    the node's `inside` piece of the group, which weights each result by its gate). Each node's
    weighted sum comes back over the link once and the source adds its nodes' sums, so a token
    crosses the inter-node link at most once per destination node each way, where the flat
    all-to-all sends it once per chosen expert there."""

    def __init__(self, across, nodes: int, inside, local: int, num_experts: int):
        self.across, self.nodes, self.per_node = across, nodes, num_experts // nodes
        self.inner = AllToAllDispatch(inside, local, self.per_node)

    def __call__(self, x: torch.Tensor, routing: Routing, experts: nn.Module) -> torch.Tensor:
        tokens, k = routing.experts.shape
        node_of = routing.experts.div(self.per_node, rounding_mode="floor")
        kept = torch.ones_like(node_of, dtype=torch.bool) if routing.kept is None else routing.kept
        token_of = torch.arange(tokens, device=x.device).unsqueeze(1).expand(tokens, k)
        on = torch.zeros(tokens, self.nodes, dtype=torch.bool, device=x.device)
        on[token_of[kept], node_of[kept]] = True
        dest, token = on.t().nonzero(as_tuple=True)  # the copies by destination node, then token
        per_node = on.sum(dim=0)
        arriving = comm.all_to_all(
            per_node, [1] * self.nodes, [1] * self.nodes, self.across, dim="ep"
        )
        send, recv = per_node.tolist(), arriving.tolist()
        there = (node_of[token] == dest.unsqueeze(1)) & kept[token]  # each copy's slots on its node
        local_ids = torch.where(
            there, routing.experts[token] - dest.unsqueeze(1) * self.per_node, -1
        )
        ids = comm.all_to_all(local_ids.to(torch.int32), send, recv, self.across, dim="ep").long()
        rows = _Exchange.apply(x[token], send, recv, self.across)
        gates = _Exchange.apply(routing.weights[token], send, recv, self.across)
        empty = gates.new_zeros(0)
        partial = self.inner(
            rows, Routing(ids.clamp(min=0), gates, empty, empty, kept=ids >= 0), experts
        )
        back = _Exchange.apply(partial, recv, send, self.across)
        return x.new_zeros(x.shape, dtype=back.dtype).index_add_(0, token, back)


def make_dispatch(topo: ExpertTopology, size: int, num_experts: int, kind: str) -> Dispatch:
    """The dispatch over the expert-parallel ("ep") groups of the experts' topology `topo`:
    hierarchical (`kind` "hierarchical", or "auto" where every group spans nodes in equal pieces)
    or flat. The config's checks refuse a hierarchical dispatch the layout cannot run before
    anything starts; the same rule refuses it here for a caller that skipped them."""
    layout = topo.layout
    problem = ep_dispatch_problem(
        size, kind, layout.node_size, f"{layout.node_size} ranks per node"
    )
    if problem:
        raise ConfigError([problem])
    split = layout.node_split("ep")
    if kind == "flat" or split is None:
        return AllToAllDispatch(topo.group("ep"), size, num_experts)
    pieces, columns = split
    across = topo.group("ep_across_nodes")
    return HierarchicalDispatch(
        across, len(columns[0]), topo.group("ep_in_node"), len(pieces[0]), num_experts
    )


def apply_expert_parallel(
    model: GPT, topo: ExpertTopology, size: int, tp: int, dispatch: str = "auto"
) -> None:
    """Keep this rank's slice of every MoE layer's experts (of the whole, initialised or meta,
    weights) and dispatch their tokens over the expert-parallel groups of the experts' topology
    `topo` (size > 1; `dispatch` is parallel.ep_dispatch); mark every expert weight EXPERTS, and
    with tensor parallelism (tp > 1) the routers and shared experts ROUTING."""
    rank = topo.coords["ep"]
    for _, block in named_blocks(model):
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        if problem := experts_split_problem(moe.router.num_experts, size):
            raise ConfigError([problem])
        for name, full in list(moe.experts.named_parameters(recurse=False)):
            p = full
            if size > 1:
                placement = Placement(tuple(full.shape), 0, rank, size)
                p = nn.Parameter(placement.local_slice(full.detach()).clone())
                set_placement(p, placement)
                setattr(moe.experts, name, p)
            setattr(p, _DOMAIN, EXPERTS)
        if tp > 1:
            for p in [
                moe.router.weight,
                *(moe.shared.parameters() if moe.shared is not None else []),
            ]:
                setattr(p, _DOMAIN, ROUTING)
        if size > 1:
            moe.dispatch = make_dispatch(topo, size, moe.router.num_experts, dispatch)
