"""Gradient-norm clipping across a parallel layout: the norm of the *global* gradient, as one
process holding the whole model would compute it (torch.nn.utils.clip_grad_norm_'s rule)."""

from __future__ import annotations

import torch

from strata.parallel import comm


def global_grad_norm(
    tp_sharded: list[torch.Tensor],
    replicated: list[torch.Tensor],
    tp_group=None,
    pp_group=None,
    partition_group=None,
    device: torch.device | None = None,
    extra_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient from this rank's pieces: squares of tp shards are
    summed over tp (replicated tensors counted once), then over `partition_group` (ranks that
    each hold a different part of the same gradients: ZeRO shards), then over the pipeline
    stages. A collective over each group given. `device` is needed when this rank holds no
    pieces (a ZeRO rank whose optimizer chunk is all padding). `extra_sq`: a squared norm already
    summed over this pipeline stage (the MoE experts', reduced over their own groups), added before
    the sum over stages."""
    zero = torch.zeros(
        (), dtype=torch.float32, device=device or (tp_sharded or replicated)[0].device
    )
    sharded_sq = sum((g.float().pow(2).sum() for g in tp_sharded), zero.clone())
    replicated_sq = sum((g.float().pow(2).sum() for g in replicated), zero.clone())
    total_sq = comm.all_reduce(sharded_sq, tp_group, dim="tp") + replicated_sq
    comm.all_reduce(total_sq, partition_group, dim="dp")
    if extra_sq is not None:
        total_sq = total_sq + extra_sq
    return comm.all_reduce(total_sq, pp_group, dim="pp").sqrt()


def scale_to_norm(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale gradients in place so that a total norm `total` becomes at most `max_norm`."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
