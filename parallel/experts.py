"""Expert parallelism (`parallel.ep`): each MoE layer's experts split over the expert-parallel group
(`parallel.topology.expert_layout`'s "tp" groups), and tokens exchanged with all-to-all so that each
rank runs only its own experts.

`apply_expert_parallel` keeps this rank's slice of every MoE layer's stacked expert weights (rows
[rank·E/ep, (rank+1)·E/ep) along dimension 0, with a `Placement`, so checkpoints hold and reshard
the whole (E, ·, ·) tensors) and marks them as expert parameters, which the ZeRO engine reduces over
the expert-data-parallel group instead of dp. `AllToAllDispatch` replaces the layer's local
dispatch: sort the token copies by expert (so by destination rank), exchange the counts, send the
tokens (`comm.all_to_all`, bytes counted per link level), run the local experts grouped by expert,
send the results back, and add them to their tokens weighted by the gates on the source rank (the
gate weights' gradient stays local). Both exchanges are autograd functions whose backward is the
reverse exchange, as Megatron-core's and torchtitan's all-to-all dispatchers do.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.model import GPT, named_blocks
from strata.moe import MoE, Routing, sort_by_expert
from strata.parallel import comm
from strata.parallel.tensor import Placement, set_placement

# The ZeRO engine reduces and partitions a parameter over its *domain*'s data-parallel ranks: "" (the
# default) the dp group; EXPERTS the expert-data-parallel ranks of `expert_layout(layout, ep)`; ROUTING
# (the router and shared experts of MoE layers under tensor parallelism, which each tp rank trains
# on its own part of the sequence) all tp·dp ranks of the stage, `expert_layout(layout, 1)`.
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
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all(x, send, recv, group, dim="ep")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
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
    return torch.cat(pieces).to(counts.device) if pieces else torch.zeros(0, dtype=torch.long, device=counts.device)


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
        returned = _Exchange.apply(done[by_expert.argsort()], recv, send, self.group)  # back in arrival order
        weights = routing.weights.flatten()[order].unsqueeze(1).to(returned.dtype)
        return x.new_zeros(x.shape, dtype=returned.dtype).index_add_(0, order // k, returned * weights)


def apply_expert_parallel(model: GPT, group, rank: int, size: int, tp: int) -> None:
    """Keep this rank's slice of every MoE layer's experts (of the whole, initialised or meta,
    weights) and dispatch their tokens over `group` (size > 1); mark every expert weight EXPERTS,
    and with tensor parallelism (tp > 1) the routers and shared experts ROUTING."""
    for _, block in named_blocks(model):
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        for name, full in list(moe.experts.named_parameters(recurse=False)):
            p = full
            if size > 1:
                placement = Placement(tuple(full.shape), 0, rank, size)
                p = nn.Parameter(placement.local_slice(full.detach()).clone())
                set_placement(p, placement)
                setattr(moe.experts, name, p)
            setattr(p, _DOMAIN, EXPERTS)
        if tp > 1:
            for p in [moe.router.weight, *(moe.shared.parameters() if moe.shared is not None else [])]:
                setattr(p, _DOMAIN, ROUTING)
        if size > 1:
            moe.dispatch = AllToAllDispatch(group, size, moe.router.num_experts)
