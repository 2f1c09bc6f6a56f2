"""Collectives through one door: thin wrappers over torch.distributed that count the bytes each
parallel dimension moves (benchmarks and tests read `bytes_moved`)."""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

bytes_moved: Counter = Counter()


def _count(dim: str, op: str, tensor: torch.Tensor) -> None:
    bytes_moved[(dim, op)] += tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group, dim: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of `tensor` over `group` (no-op without one)."""
    if group is not None:
        _count(dim, "all_reduce", tensor)
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, dim: str) -> list[torch.Tensor]:
    """Every group member's `tensor` (same shape on all), in group-rank order."""
    if group is None:
        return [tensor]
    _count(dim, "all_gather", tensor)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_objects(obj, group, dst: int) -> list | None:
    """Every group member's picklable `obj` at global rank `dst` (None elsewhere). In-process
    control data only (pickled over the wire by torch); not counted, not for hot paths."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
