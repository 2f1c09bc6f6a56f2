"""ZeRO-1 partitioning of optimizer state over a hierarchy level, with ZeRO-2's reduce-scatter of
gradients: the first part of the partitioning engine. Not yet: freeing each gradient bucket as
soon as backward has reduced it (ZeRO-2's memory saving: the full gradient buffer stays
allocated here), ZeRO-3 parameter sharding with prefetch, hpZ, per-state levels, and the config
and trainer wiring — all issue 4.

Parameters are packed per block into flat buffers (`parallel.flat`), matrices and vectors apart
(only matrices get weight decay). Each parameter's `.grad` is a view into a matching flat
gradient buffer, so backward (also inside pipeline schedules, also over accumulated
micro-batches) sums straight into it. At `step()` each gradient buffer is reduced
hierarchically — reduce-scatter inside the shard group (the data-parallel ranks that share the
chosen hardware unit: the fast links), then all-reduce of the shard across the replica group
(the same shard in the other units) — so every rank ends with the data-parallel mean of its own
shard. The optimizer holds state for that shard only, steps it in place in the parameter
buffer, and an all-gather inside the shard group puts the whole updated block back on every
rank.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.clipping import global_grad_norm, scale_to_norm
from parallel.flat import FlatBuffer
from parallel.tensor import placement_of
from parallel.topology import Topology


@dataclass(frozen=True)
class ShardGroups:
    """Where state is partitioned: `shard` splits it (None: one rank, nothing split), `replica`
    joins the copies of one shard (None: no copies), over a data-parallel group of `dp_size`."""
    shard: object
    replica: object
    shard_rank: int
    shard_size: int
    dp_size: int


def shard_groups(topo: Topology, level: str) -> ShardGroups:
    """The groups that partition state at hierarchy `level` (none, gcd, gpu, node, global)."""
    index, size = topo.shard_position(level)
    return ShardGroups(topo.level_group(level, within_dp=True), topo.level_group(level, replica=True),
                       index, size, topo.dp_size)


def block_key(name: str) -> str:
    """The flat-buffer group of a parameter: its transformer block, or the module outside them."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


@dataclass
class _Bucket:
    params: FlatBuffer
    grads: torch.Tensor        # flat gradient buffer; the parameters' .grad are views into it
    shard: nn.Parameter        # this rank's slice of `params`, what the optimizer steps
    tp_sharded: bool


class ZeroOptimizer:
    """An optimizer over this rank's shards. `make_optimizer(param_groups)` builds the inner
    optimizer (e.g. AdamW) from groups of shard parameters with their weight decay."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], groups: ShardGroups,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], weight_decay: float):
        self.groups = groups
        by_block: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = defaultdict(list)
        for name, p in named_params:
            by_block[(block_key(name), p.ndim >= 2)].append((name, p))
        self.buckets: list[_Bucket] = []
        decayed, plain = [], []
        for (_, is_matrix), members in by_block.items():
            sharded = {placement_of(p).shard_dim is not None for _, p in members}
            if len(sharded) > 1:  # keeps the norm computation exact: one rule per bucket
                raise ValueError(f"block {members[0][0]}: mixes tensor-parallel shards and replicated parameters")
            flat = FlatBuffer(members, groups.shard_size)
            grads = torch.zeros_like(flat.data)
            for seg, (_, p) in zip(flat.segments, members):
                p.grad = grads[seg.offset:seg.offset + seg.numel].view(seg.shape)
            shard = nn.Parameter(flat.shard(groups.shard_rank))
            self.buckets.append(_Bucket(flat, grads, shard, sharded.pop()))
            (decayed if is_matrix else plain).append(shard)
        self.optimizer = make_optimizer([{"params": decayed, "weight_decay": weight_decay},
                                         {"params": plain, "weight_decay": 0.0}])

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def reduce_gradients(self) -> None:
        """Each rank's shard of the data-parallel mean gradient, in its shard parameter's .grad."""
        g = self.groups
        for b in self.buckets:
            shard = comm.reduce_scatter_along(b.grads, g.shard, dim="dp", axis=0)
            comm.all_reduce(shard, g.replica, dim="dp")
            b.shard.grad = shard.div_(g.dp_size)

    def clip_grad_norm(self, max_norm: float, tp_group=None, pp_group=None) -> torch.Tensor:
        """Clip the reduced shard gradients by the norm of the whole model's gradient."""
        total = global_grad_norm([b.shard.grad for b in self.buckets if b.tp_sharded],
                                 [b.shard.grad for b in self.buckets if not b.tp_sharded],
                                 tp_group, pp_group, partition_group=self.groups.shard)
        if math.isfinite(max_norm):
            scale_to_norm([b.shard.grad for b in self.buckets], max_norm, total)
        return total

    def step(self) -> None:
        """Step the shards, then all-gather every block's updated parameters in the shard group."""
        self.optimizer.step()
        for b in self.buckets:
            if self.groups.shard is not None:
                b.params.data.copy_(comm.all_gather_along(b.shard.detach(), self.groups.shard, dim="dp", axis=0))

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grads.zero_()
            b.shard.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t))
