"""Tensor parallelism (Megatron's scheme) applied to a plain GPT from outside.

Attention heads and the MLP's inner width are split column-wise (wq/wk/wv, w1/w3) and their
output projections row-wise (wo, w2); the embedding and the output layer are split over the
vocabulary, and the loss is a vocab-parallel cross-entropy, so no rank ever holds full-vocab
logits. Shards are plain local tensors (not DTensors) so the optimizer, ZeRO and checkpoints
treat them as ordinary parameters; each records its `Placement` in the global tensor.

Written here rather than with torch's DTensor `parallelize_module` because the issue requires
plain local shards and Megatron's vocab-parallel loss, which DTensor's loss_parallel only gives
inside its own tensor subclass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import comm
from trainer.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its global tensor: split evenly along `shard_dim` into
    `num_shards` pieces of which this is number `shard_index`; shard_dim None = replicated."""
    global_shape: tuple[int, ...]
    shard_dim: int | None = None
    shard_index: int = 0
    num_shards: int = 1

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        if self.shard_dim is None:
            return full
        return full.chunk(self.num_shards, dim=self.shard_dim)[self.shard_index]


def placement_of(p: torch.Tensor) -> Placement:
    return getattr(p, "placement", None) or Placement(tuple(p.shape))


# --- communication with autograd (Megatron's f / g operators) ------------------------------

class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input feeds every shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group, dim="tp"), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward (sum the shards' partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous().clone(), group, dim="tp")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits (N, V/tp) against global targets (N,)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        logits_max = comm.all_reduce(logits.max(dim=-1).values, group, dim="tp", op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (targets < vocab_start) | (targets >= vocab_start + logits.shape[-1])
        local_targets = (targets - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group, dim="tp")
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group, dim="tp")
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_targets)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local_targets = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_targets] -= (~outside).to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


# --- sharded layers ------------------------------------------------------------------------

def _shard_parameter(full: torch.Tensor, dim: int, rank: int, size: int) -> nn.Parameter:
    if full.shape[dim] % size:
        raise ConfigError([f"parallel.tp={size} must divide a weight's dimension {dim} of size {full.shape[dim]} "
                           f"(shape {tuple(full.shape)}); choose model sizes divisible by tp"])
    placement = Placement(tuple(full.shape), dim, rank, size)
    p = nn.Parameter(placement.local_slice(full.detach()).clone())
    p.placement = placement
    return p


class ColumnParallelLinear(nn.Module):
    """y_local = x W_localᵀ with W split by output rows; the output stays split."""

    def __init__(self, linear: nn.Linear, group, rank: int, size: int):
        super().__init__()
        self.group = group
        self.weight = _shard_parameter(linear.weight, 0, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group), self.weight)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local W_localᵀ with W split by input columns; input arrives split."""

    def __init__(self, linear: nn.Linear, group, rank: int, size: int):
        super().__init__()
        self.group = group
        self.weight = _shard_parameter(linear.weight, 1, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks; each looks up the ids it owns, the rest are summed in."""

    def __init__(self, embedding: nn.Embedding, group, rank: int, size: int):
        super().__init__()
        self.group = group
        self.weight = _shard_parameter(embedding.weight, 0, rank, size)
        self.vocab_start = rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.weight.shape[0])
        local = F.embedding((tokens - self.vocab_start).masked_fill(outside, 0), self.weight)
        return _ReduceFromGroup.apply(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class VocabParallelLoss:
    """Mean next-token cross-entropy over vocab-sharded logits (batch, seq, V/tp)."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        start = self.rank * logits.shape[-1]
        per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), start, self.group)
        return per_token.mean()


# --- the transformation ----------------------------------------------------------------------

def apply_tensor_parallel(model: nn.Module, group, rank: int, size: int) -> VocabParallelLoss:
    """Shard a GPT in place over the tp group (slicing its full, already-initialised weights, so
    the sharded model computes what the unsharded one would). Returns the loss to train it with."""
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        attn.wq, attn.wk, attn.wv = (ColumnParallelLinear(m, group, rank, size) for m in (attn.wq, attn.wk, attn.wv))
        attn.wo = RowParallelLinear(attn.wo, group, rank, size)
        mlp.w1, mlp.w3 = ColumnParallelLinear(mlp.w1, group, rank, size), ColumnParallelLinear(mlp.w3, group, rank, size)
        mlp.w2 = RowParallelLinear(mlp.w2, group, rank, size)
    tied = model.output.weight is model.tok_embeddings.weight
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, rank, size)
    output = ColumnParallelLinear(model.output, group, rank, size)
    if tied:
        output.weight = model.tok_embeddings.weight
    model.output = output
    return VocabParallelLoss(group, rank)
