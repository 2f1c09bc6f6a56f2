"""Data parallelism: average gradients over the dp group after backward, in flat buckets so a
model with many small parameters needs few collectives."""
from __future__ import annotations

import torch
from torch import nn

from strata.parallel import comm


class GradientBuckets:
    """Parameters grouped into buckets of about `bucket_bytes`, in reverse registration order
    (the order backward produces gradients, so a later overlapped version can start early)."""

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int):
        self.buckets: list[list[nn.Parameter]] = []
        current, size = [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)

    def all_reduce_mean(self, group, world: int) -> None:
        """Replace each gradient with its mean over the group."""
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group, dim="dp")
            flat.div_(world)
            offset = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                p.grad = flat[offset:offset + n].view_as(p)
                offset += n


def unique_params(*modules: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of the modules, once each (tied weights, also across modules, once)."""
    return list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
