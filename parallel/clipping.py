"""Gradient-norm clipping across a parallel layout: the norm of the *global* gradient, as one
process holding the whole model would compute it (torch.nn.utils.clip_grad_norm_'s rule)."""
from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.tensor import placement_of


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, tp_group=None, pp_group=None,
                   counted_elsewhere: list[nn.Parameter] = ()) -> torch.Tensor:
    """Squared norms of tp shards are summed over the tp group (replicated parameters counted
    once); each pipeline rank holds different layers, so totals are summed over pp. Parameters in
    `counted_elsewhere` (a tied embedding's second copy) are clipped but not counted again."""
    if tp_group is None and pp_group is None and not counted_elsewhere:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # one rank holds everything
    skip = {id(p) for p in counted_elsewhere}
    counted = [p for p in params if p.grad is not None and id(p) not in skip]
    zero = torch.zeros((), dtype=torch.float32, device=params[0].device)
    sharded = sum((p.grad.float().pow(2).sum() for p in counted if placement_of(p).shard_dim is not None), zero.clone())
    replicated = sum((p.grad.float().pow(2).sum() for p in counted if placement_of(p).shard_dim is None), zero.clone())
    comm.all_reduce(sharded, tp_group, dim="tp")
    total = comm.all_reduce(sharded + replicated, pp_group, dim="pp").sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
