"""Tensor parallelism (Megatron's scheme) applied to a plain GPT from outside.

Attention heads and the MLP's inner width are split column-wise (wq/wk/wv with their biases,
w1/w3) and their output projections row-wise (wo, w2); the per-head q/k norms are replicated
(one weight of head_dim serves every head; see `TensorParallelHeadNorm`); the embedding and the
output layer are split over the vocabulary, and the loss is a vocab-parallel cross-entropy, so
no rank ever holds full-vocab logits. Shards are plain local tensors (not DTensors) so the
optimizer, ZeRO and checkpoints treat them as ordinary parameters; each records its `Placement`
in the global tensor.

Optional sequence parallelism (Korthikanti et al. 2022, Megatron's `sequence_parallel`): between
the tensor-parallel regions the residual stream is split along the sequence (dim 1 of the
batch-first (batch, seq, d) activations), so each rank holds and normalises s/tp positions. The
embedding's partial sums and the row-parallel outputs are reduce-scattered along the sequence
instead of all-reduced; the normed shard is all-gathered along the sequence on its way into the
column-parallel linears. Per block that is, forward, 2 all-gathers + 2 reduce-scatters (instead of
2 all-reduces) and the same in backward, moving the same bytes as plain TP. The norm weights,
replicated but seeing only part of the sequence, have their gradients all-reduced over tp inside
autograd (see `TensorParallelRMSNorm`), so the training loop needs no SP-specific step.

Written here rather than with torch's DTensor `parallelize_module` because Strata wants plain
local shards (which the ZeRO engine, the memory tiers and the checkpoint format take as they are)
and Megatron's vocab-parallel loss, which DTensor's loss_parallel only gives inside its own tensor
subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from strata.config.vocabulary import tensor_split_problems
from strata.errors import ConfigError
from strata.lora import adapter_of, attach
from strata.model import GPT, IGNORE_INDEX, Block, RMSNorm, SwiGLU
from strata.moe import MoE
from strata.parallel import comm
from strata.parallel.flat import Box


@dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its global tensor: split evenly along `shard_dim` into
    `num_shards` pieces of which this is number `shard_index`; shard_dim None = replicated."""

    global_shape: tuple[int, ...]
    shard_dim: int | None = None
    shard_index: int = 0
    num_shards: int = 1

    def box(self, local_shape: tuple[int, ...]) -> Box:
        """The box (offsets, sizes) a local shard of `local_shape` covers in the global tensor."""
        offsets = [0] * len(local_shape)
        if self.shard_dim is not None:
            offsets[self.shard_dim] = self.shard_index * local_shape[self.shard_dim]
        return Box(tuple(offsets), tuple(local_shape))

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        if self.shard_dim is None:
            return full
        return full.chunk(self.num_shards, dim=self.shard_dim)[self.shard_index]


# the attribute a shard carries its Placement in (torch.Tensor declares none)
_PLACEMENT = "placement"


def placement_of(p: torch.Tensor) -> Placement:
    """Where tensor `p` sits in its global tensor: the Placement a shard carries, else whole
    (replicated) with its own shape."""
    return getattr(p, _PLACEMENT, None) or Placement(tuple(p.shape))


def set_placement(p: torch.Tensor, placement: Placement) -> None:
    """Record where shard `p` sits in its global tensor (`placement_of` reads it)."""
    setattr(p, _PLACEMENT, placement)


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


SEQ_DIM = 1  # activations are batch-first: (batch, seq, d)


class _SequenceExchange(torch.autograd.Function):
    """Sequence parallelism's two exchanges, each the other's transpose. With `gather`: all-gather
    along the sequence forward, reduce-scatter of the gradient backward (each rank's TP region
    computes a partial gradient of the whole sequence; the owner of a shard needs the sum), the
    sequence-parallel counterpart of `_CopyToGroup`. Without: reduce-scatter forward (sum the
    shards' partial outputs, keep this rank's positions), all-gather of the gradient backward, the
    counterpart of `_ReduceFromGroup`."""

    @staticmethod
    def forward(ctx, x, group, gather: bool):
        ctx.group, ctx.gather = group, gather
        return _along_sequence(x, group, gather)

    @staticmethod
    def backward(ctx, grad):
        return _along_sequence(grad, ctx.group, not ctx.gather), None, None


def _along_sequence(x: torch.Tensor, group, gather: bool) -> torch.Tensor:
    exchange = comm.all_gather_along if gather else comm.reduce_scatter_along
    return exchange(x, group, dim="tp", axis=SEQ_DIM)


class _SequenceDirection:
    """One direction of `_SequenceExchange`, applied as the other autograd functions here are."""

    def __init__(self, gather: bool):
        self.gather = gather

    def apply(self, x: torch.Tensor, group) -> torch.Tensor:
        """The exchange of `x` over `group`, with autograd."""
        return _SequenceExchange.apply(x, group, self.gather)


_GatherFromSequence = _SequenceDirection(gather=True)
_ReduceScatterToSequence = _SequenceDirection(gather=False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits (N, V/tp) against global targets (N,)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        logits_max = comm.all_reduce(
            logits.max(dim=-1).values, group, dim="tp", op=dist.ReduceOp.MAX
        )
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (targets < vocab_start) | (targets >= vocab_start + logits.shape[-1])
        local_targets = (targets - vocab_start).masked_fill(outside, 0)
        target_logit = (
            shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        )
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
    if full.shape[dim] % size:  # the model's sizes passed `tensor_split_problems`: a caller's bug
        raise ValueError(
            f"cannot split dimension {dim} of a weight of shape {tuple(full.shape)} into {size}"
        )
    placement = Placement(tuple(full.shape), dim, rank, size)
    p = nn.Parameter(placement.local_slice(full.detach()).clone())
    set_placement(p, placement)
    return p


_COLUMN_ENTRIES = ("copy", "gather", "ready")

# The local product of a tensor-parallel linear layer, (x, weight shard, bias shard) -> y: F.linear,
# or a float8 matmul that train.precision=fp8 puts in its place (the collectives around it stay the
# same).
LocalMatmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class ColumnParallelLinear(nn.Module):
    """y_local = x W_localᵀ with W split by output rows; the output stays split.

    `entry` says how x enters the tensor-parallel region: "copy" (x is replicated over tp: identity
    forward, all-reduce of its gradient backward), "gather" (x is sequence-sharded: all-gather
    along the sequence forward, reduce-scatter backward) or "ready" (an upstream module already
    did one of those, e.g. a norm whose output feeds several linears, so they share one gather)."""

    def __init__(self, linear: nn.Linear, group, rank: int, size: int, entry: str = "copy"):
        super().__init__()
        if entry not in _COLUMN_ENTRIES:
            raise ValueError(
                f"ColumnParallelLinear entry={entry!r}; expected one of {_COLUMN_ENTRIES}"
            )
        self.group, self.entry = group, entry
        self.weight = _shard_parameter(linear.weight, 0, rank, size)
        self.bias = None if linear.bias is None else _shard_parameter(linear.bias, 0, rank, size)
        self.matmul: LocalMatmul = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry == "copy":
            x = _CopyToGroup.apply(x, self.group)
        elif self.entry == "gather":
            x = _GatherFromSequence.apply(x, self.group)
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local W_localᵀ with W split by input columns; input arrives split. The sum is
    an all-reduce, or with `sequence_parallel` a reduce-scatter along the sequence (each rank
    keeps the summed output of its s/tp positions)."""

    def __init__(
        self, linear: nn.Linear, group, rank: int, size: int, sequence_parallel: bool = False
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard_parameter(linear.weight, 1, rank, size)
        self.matmul: LocalMatmul = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = _ReduceScatterToSequence if self.sequence_parallel else _ReduceFromGroup
        return reduce.apply(self.matmul(x, self.weight, None), self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks; each looks up the ids it owns, the rest are summed in (with
    `sequence_parallel`, reduce-scattered along the sequence: each rank gets its s/tp positions)."""

    def __init__(
        self, embedding: nn.Embedding, group, rank: int, size: int, sequence_parallel: bool = False
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard_parameter(embedding.weight, 0, rank, size)
        self.vocab_start = rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.weight.shape[0])
        local = F.embedding((tokens - self.vocab_start).masked_fill(outside, 0), self.weight)
        reduce = _ReduceScatterToSequence if self.sequence_parallel else _ReduceFromGroup
        return reduce.apply(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class TensorParallelRMSNorm(nn.Module):
    """The model's RMSNorm (same `weight` Parameter object, so names, init and checkpoints are
    unchanged) at the entry of a tensor-parallel region: its output is handed to every
    column-parallel linear that reads it (wq, wk, wv after attn_norm; w1, w3 after mlp_norm; they
    take entry="ready"), so the region is entered once — one gradient all-reduce in backward
    instead of one per linear (Megatron gets the same from its fused QKV linear).

    With `sequence_parallel` the norm runs on this rank's sequence shard (batch, s/tp, d) and the
    entry is an all-gather along the sequence (reduce-scatter backward). The weight is replicated
    over tp but each rank's backward only sees s/tp of the positions, so the true gradient is the
    sum of the ranks' partial ones. Megatron sums them after backward (the trainer all-reduces
    grads of params marked `sequence_parallel`). Here the weight goes through `_CopyToGroup`
    (identity forward, all-reduce over tp of its gradient backward) before use: the reduction is
    part of the autograd graph, so every backward leaves `.grad` complete and equal on all tp
    ranks, with no step added to the loop, and accumulation over micro-batches stays exact. The
    price is one all-reduce of d floats per norm per backward instead of one coalesced per step.

    `enter=False` (the final norm under SP) only normalises the shard: the output layer gathers."""

    def __init__(self, norm: RMSNorm, group, sequence_parallel: bool, enter: bool = True):
        super().__init__()
        self.group, self.sequence_parallel, self.enter, self.eps = (
            group,
            sequence_parallel,
            enter,
            norm.eps,
        )
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same computation as strata.model.RMSNorm.forward.
        weight = (
            _CopyToGroup.apply(self.weight, self.group) if self.sequence_parallel else self.weight
        )
        y = F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        if not self.enter:
            return y
        return (_GatherFromSequence if self.sequence_parallel else _CopyToGroup).apply(
            y, self.group
        )


class TensorParallelHeadNorm(nn.Module):
    """The attention's per-head q/k RMSNorm (same `weight` Parameter) on this rank's heads. The
    weight (head_dim,) is replicated, but each rank normalises only its own heads, so its local
    gradient is a partial sum over heads; as for the norms under sequence parallelism, the weight
    goes through `_CopyToGroup`, whose backward all-reduces that gradient over tp, leaving it
    complete and equal on every rank (Megatron all-reduces its qk-layernorm gradients the same way,
    after backward)."""

    def __init__(self, norm: RMSNorm, group):
        super().__init__()
        self.group, self.eps = group, norm.eps
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _CopyToGroup.apply(self.weight, self.group)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class AdapterLinear(nn.Module):
    """One half of a LoRA adapter (`strata.lora`) on a tensor-parallel layer, keeping the plain
    half's `weight` name. Of a column-parallel layer: A whole, and B split by output rows as the
    layer's weight is (the product lands on this rank's outputs). Of a row-parallel layer: A split
    by input columns as the layer's weight is, its partial products summed over tp (`reduce`: an
    all-reduce of the rank-r activations, or with sequence parallelism a reduce-scatter along the
    sequence, as the layer sums its own), and B whole.

    A whole A of a column-parallel layer sees only this rank's share of its output's gradient, so
    its gradient is a partial sum: the weight goes through `_CopyToGroup` (its backward all-reduces
    that gradient over tp, as `TensorParallelHeadNorm`'s does); so does a whole B under sequence
    parallelism, which sees only this rank's positions."""

    def __init__(
        self,
        half: nn.Module,
        group,
        rank: int,
        size: int,
        shard_dim: int | None,
        reduce: _SequenceDirection | type[_ReduceFromGroup] | None = None,
        partial_grad: bool = False,
    ):
        super().__init__()
        self.group, self.reduce, self.partial_grad = group, reduce, partial_grad
        weight = half.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = (
            weight if shard_dim is None else _shard_parameter(weight, shard_dim, rank, size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x times this half's weight (transposed), summed over tp where `reduce` says."""
        weight = _CopyToGroup.apply(self.weight, self.group) if self.partial_grad else self.weight
        y = F.linear(x, weight)
        return y if self.reduce is None else self.reduce.apply(y, self.group)


def _carry_adapter(
    plain: nn.Module, sharded: nn.Module, group, rank: int, size: int, column: bool, sp: bool
) -> None:
    """The plain layer's adapter, if any, on its tensor-parallel counterpart (`AdapterLinear`)."""
    adapter = adapter_of(plain)
    if adapter is None:
        return
    a, b, dropout, scale = adapter
    if column:
        lora_A = AdapterLinear(a, group, rank, size, None, partial_grad=True)
        lora_B = AdapterLinear(b, group, rank, size, 0)
    else:
        reduce = _ReduceScatterToSequence if sp else _ReduceFromGroup
        lora_A = AdapterLinear(a, group, rank, size, 1, reduce=reduce)
        lora_B = AdapterLinear(b, group, rank, size, None, partial_grad=sp)
    attach(sharded, lora_A, lora_B, dropout, scale)


# The layers above whose forward or backward talks to the other tensor-parallel ranks. Regional
# compilation runs them eagerly: a collective traced into a graph would run its Python side (the
# byte counters, the watchdog's bookkeeping) once at trace time instead of at every call.
COMMUNICATING = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    TensorParallelRMSNorm,
    TensorParallelHeadNorm,
    AdapterLinear,
)


class VocabParallelLoss:
    """Next-token cross-entropy over vocab-sharded logits (batch, seq, V/tp), as `lm_loss`: the
    mean over the targets, or with `reduction` "sum" the sum over those not IGNORE_INDEX, or with
    "none" each target's (flat, 0 at IGNORE_INDEX)."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
    ) -> torch.Tensor:
        start = self.rank * logits.shape[-1]
        targets = targets.flatten()
        per_token = _VocabParallelCrossEntropy.apply(
            logits.flatten(0, 1), targets, start, self.group
        )
        if reduction == "mean":
            return per_token.mean()
        # an ignored target falls outside every rank's slice: its loss (the log-sum-exp) is dropped
        # here, and with it its gradient
        kept = torch.where(targets != IGNORE_INDEX, per_token, 0.0)
        return kept if reduction == "none" else kept.sum()


class SequenceShards:
    """An MoE layer's tokens under sequence parallelism: each rank of the tp group routes its part
    of the sequence; the routing counts its auxiliary losses need are summed over the group."""

    loss_weight = 1  # the tp ranks' router gradients are summed, not averaged

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(counts.clone(), self.group, dim="tp")


# --- the transformation ----------------------------------------------------------------------


def apply_tensor_parallel(
    model: GPT, group, rank: int, size: int, sequence_parallel: bool = False
) -> VocabParallelLoss:
    """Shard a GPT in place over the tp group (slicing its full, already-initialised weights, so
    the sharded model computes what the unsharded one would). Returns the loss to train it with.

    With `sequence_parallel` (and size > 1) the activations between the tensor-parallel regions
    (embedding output, residual stream, norms) hold seq_len/size positions per rank; the logits
    are still (batch, seq, vocab/size) over the whole sequence, so the loss is unchanged."""
    sp = sequence_parallel and size > 1
    problems = tensor_split_problems(model.cfg, size, sp)
    if problems:  # the config's own rules, which its checks reported before anything started
        raise ConfigError(problems)
    for block in model.layers:  # the norms enter each region once; the linears after them share it
        assert isinstance(block, Block)
        attn, mlp = block.attn, block.mlp
        # An MoE feed-forward (strata.moe; sequence parallelism required) is no tensor-parallel
        # region: each rank routes its own part of the sequence (parallel.experts lays the experts
        # out).
        moe = isinstance(mlp, MoE)
        _swap(
            block,
            attn_norm=TensorParallelRMSNorm(block.attn_norm, group, sp),
            mlp_norm=TensorParallelRMSNorm(block.mlp_norm, group, sp, enter=not moe),
        )
        wq, wk, wv = (
            ColumnParallelLinear(m, group, rank, size, entry="ready")
            for m in (attn.wq, attn.wk, attn.wv)
        )
        wo = RowParallelLinear(attn.wo, group, rank, size, sequence_parallel=sp)
        for plain, sharded in ((attn.wq, wq), (attn.wk, wk), (attn.wv, wv), (attn.wo, wo)):
            _carry_adapter(plain, sharded, group, rank, size, sharded is not wo, sp)
        _swap(attn, wq=wq, wk=wk, wv=wv, wo=wo)
        if attn.q_norm is not None and attn.k_norm is not None and size > 1:
            _swap(
                attn,
                q_norm=TensorParallelHeadNorm(attn.q_norm, group),
                k_norm=TensorParallelHeadNorm(attn.k_norm, group),
            )
        if isinstance(mlp, MoE):
            mlp.shards = SequenceShards(group, size)
            continue
        assert isinstance(mlp, SwiGLU)
        w1, w3 = (
            ColumnParallelLinear(m, group, rank, size, entry="ready") for m in (mlp.w1, mlp.w3)
        )
        w2 = RowParallelLinear(mlp.w2, group, rank, size, sequence_parallel=sp)
        for plain, sharded in ((mlp.w1, w1), (mlp.w3, w3), (mlp.w2, w2)):
            _carry_adapter(plain, sharded, group, rank, size, sharded is not w2, sp)
        _swap(mlp, w1=w1, w3=w3, w2=w2)
    if sp:
        _swap(model, norm=TensorParallelRMSNorm(model.norm, group, sp, enter=False))
    tied = model.output.weight is model.tok_embeddings.weight
    embedding = VocabParallelEmbedding(
        model.tok_embeddings, group, rank, size, sequence_parallel=sp
    )
    _swap(model, tok_embeddings=embedding)
    output = ColumnParallelLinear(model.output, group, rank, size, entry="gather" if sp else "copy")
    if tied:
        output.weight = embedding.weight
    _swap(model, output=output)
    return VocabParallelLoss(group, rank)


def _swap(parent: nn.Module, **children: nn.Module) -> None:
    """Replace `parent`'s submodules by name with their parallel counterparts (nn.Module's
    __setattr__ registers them; the model's classes type those attributes as the plain modules)."""
    for name, child in children.items():
        setattr(parent, name, child)
