"""Gradient-norm clipping across a parallel layout: the norm of the *global* gradient, as one
process holding the whole model would compute it (torch.nn.utils.clip_grad_norm_'s rule)."""
from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.tensor import placement_of


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, tp_group=None, pp_group=None) -> torch.Tensor:
    """Squared norms of tp shards are summed over the tp group (replicated parameters counted
    once); each pipeline rank holds different layers, so the totals are summed over pp."""
    grads = [p.grad for p in params if p.grad is not None]
    zero = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    sharded = sum((p.grad.float().pow(2).sum() for p in params
                   if p.grad is not None and placement_of(p).shard_dim is not None), zero.clone())
    replicated = sum((p.grad.float().pow(2).sum() for p in params
                      if p.grad is not None and placement_of(p).shard_dim is None), zero.clone())
    comm.all_reduce(sharded, tp_group, dim="tp")
    total_sq = comm.all_reduce(sharded + replicated, pp_group, dim="pp")
    total = total_sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
