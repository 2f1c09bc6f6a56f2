"""The Mixture-of-Experts feed-forward layer (`model.moe`), as plain torch modules with no parallel
code inside: a router that picks `top_k` of `num_experts` SwiGLU experts for each token, the
experts as stacked 3-D weights (one slice per expert along dimension 0, so expert parallelism and
checkpoints slice them like any tensor), optional shared experts every token passes through, the
load-balancing losses, and routing statistics.

Routers: softmax over every expert's logit, top-k, optionally renormalised (Mixtral, Qwen3-MoE);
or sigmoid scores (DeepSeek-V3), whose top-k choice may add a per-expert bias that load-balances
without an auxiliary loss (`expert_bias`, updated between steps by `update_expert_bias`), and may be
limited to a few groups of experts (`limit_groups`: node-limited routing when the groups are nodes). Routing
runs in fp32. Dropless by default; `capacity_factor` caps each expert at
ceil(factor · tokens · top_k / num_experts) assignments, keeping the highest-weighted ones.

How tokens reach their experts is a `Dispatch` the layer holds: `LocalDispatch` (every expert on
this rank) by default; expert parallelism (`strata.parallel.experts`) swaps in one that exchanges
tokens between ranks with all-to-all. The auxiliary losses do not change the layer's output: their
gradient is injected into backward at the router (`AuxLossGrad`, as Megatron-core's
`MoEAuxLossAutoScaler`), so the training loss reported stays the language-model loss and a pipeline
stage needs to send nothing extra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.config.schema import ModelConfig


class AuxLossGrad(torch.autograd.Function):
    """Identity on `out` forward; backward also gives `aux` the gradient `scale` (the weight of
    one micro-batch's loss in the step's mean), so `aux` trains the router as if added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return (
            grad,
            torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device),
            None,
        )


@dataclass
class Routing:
    """One micro-batch's routing of T tokens: each token's experts and gate weights (T, k), the
    router's logits and scores (T, E, fp32), and which assignments survive the capacity (T, k)."""

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor
    kept: torch.Tensor | None = None  # None: every assignment (dropless)


class Router(nn.Module):
    """Scores every expert for each token and picks `top_k` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.kind = moe.num_experts, moe.top_k, moe.router
        self.norm_topk, self.scale, self.capacity_factor = (
            moe.norm_topk,
            moe.routed_scale,
            moe.capacity_factor,
        )
        self.groups, self.group_limit = moe.route_groups, moe.route_group_limit
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.d_model))
        if moe.bias_update_rate > 0:  # saved with the model, changed only by update_expert_bias
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        else:
            self.expert_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.groups > 1:
            choice = limit_groups(choice, self.groups, self.group_limit)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        routing = Routing(experts, weights * self.scale, logits, scores)
        if self.capacity_factor is not None:
            routing.kept = within_capacity(routing, self.num_experts, self.capacity_factor)
        return routing


def limit_groups(choice: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the experts (T, E) as `groups` equal groups, each scored by
    the sum of its two best choices, and every expert outside each token's `limit` best groups set
    to -inf, so top-k picks inside them (with groups on separate nodes: node-limited routing)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, groups, experts // groups)
    best = grouped.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)
    chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(
        1, best.topk(limit, dim=-1).indices, True
    )
    return grouped.masked_fill(~chosen.unsqueeze(-1), float("-inf")).view(tokens, experts)


def within_capacity(routing: Routing, num_experts: int, factor: float) -> torch.Tensor:
    """(T, k) bool: the assignments each expert keeps, at most ceil(factor·T·k/E) per expert, the
    highest gate weights first (Megatron-core's drop policy "probs")."""
    tokens, k = routing.experts.shape
    capacity = math.ceil(factor * tokens * k / num_experts)
    flat_expert, flat_weight = routing.experts.flatten(), routing.weights.detach().flatten()
    by_weight = flat_weight.argsort(descending=True, stable=True)
    # by expert, then weight descending
    order = by_weight[flat_expert[by_weight].argsort(stable=True)]
    counts = torch.bincount(flat_expert, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
    kept = torch.empty_like(flat_expert, dtype=torch.bool)
    kept[order] = rank_in_expert < capacity
    return kept.view(tokens, k)


class Experts(nn.Module):
    """`count` SwiGLU experts as stacked weights: w1 (gate) and w3 (up) (count, hidden, d_model),
    w2 (down) (count, d_model, hidden). Under expert parallelism a rank holds a slice of them."""

    def __init__(self, count: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(count, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(count, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(count, d_model, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert (N, d_model), `counts[e]` of them for local expert e."""
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        if grouped_mm_fits(x, self.w1, dtype):
            x, offsets = x.to(dtype), counts.cumsum(0).to(torch.int32)
            w1, w3, w2 = (w.to(dtype).transpose(1, 2) for w in (self.w1, self.w3, self.w2))
            with torch.autocast(kind, enabled=False):
                gate, up = (
                    torch._grouped_mm(x, w1, offs=offsets),
                    torch._grouped_mm(x, w3, offs=offsets),
                )
                return torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)
        return self.loop(x, counts)

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same product expert by expert (the reference, and where grouped GEMM cannot run)."""
        outs = []
        for e, part in enumerate(x.split(counts.tolist())):
            outs.append(
                F.linear(
                    F.silu(F.linear(part, self.w1[e])) * F.linear(part, self.w3[e]), self.w2[e]
                )
            )
        return torch.cat(outs) if outs else x[:0]


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul takes these operands in `dtype`: present in this torch, fp32
    on a CPU or bf16 with rows whose strides are multiples of 16 bytes (a GPU's grouped GEMM)."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if dtype == torch.float32:
        return x.device.type == "cpu"
    return dtype == torch.bfloat16 and weight.shape[1] % 8 == 0 and weight.shape[2] % 8 == 0


class Dispatch(Protocol):
    """Takes each token to its experts and the results back: returns (T, d) = Σ_k weight·expert(x)."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor: ...


def sort_by_expert(
    experts: torch.Tensor, kept: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept assignments' flat (token·k + slot) indices ordered by expert, stable in token order."""
    flat = experts.flatten()
    index = torch.arange(flat.numel(), device=flat.device)
    if kept is not None:
        index = index[kept.flatten()]
    return index[flat[index].argsort(stable=True)], flat


class LocalDispatch:
    """Every expert on this rank: sort the assignments by expert, run the experts, add each
    result back to its token scaled by its gate weight."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        k = routing.experts.shape[1]
        order, flat = sort_by_expert(routing.experts, routing.kept)
        counts = torch.bincount(flat[order], minlength=experts.w1.shape[0])
        out = experts(x[order // k], counts)
        weights = routing.weights.flatten()[order].unsqueeze(1).to(out.dtype)
        return x.new_zeros(x.shape, dtype=out.dtype).index_add_(0, order // k, out * weights)


class SharedExperts(nn.Module):
    """The shared experts every token passes through, as one SwiGLU of their joint width
    (DeepSeek's layout), with Qwen2-MoE's optional sigmoid gate on the output."""

    def __init__(self, d_model: int, hidden: int, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out if self.gate is None else out * torch.sigmoid(self.gate(x))


class RoutingStats:
    """What one MoE layer's routing did since the last `reset`, summed over its forward calls, kept
    on the device (reading it is the only synchronisation): assignments per expert after the
    capacity, forward calls, tokens, dropped assignments, and the auxiliary losses' values."""

    FIELDS = ("calls", "tokens", "dropped", "aux", "seq_aux", "z")

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.total: torch.Tensor | None = None

    def reset(self) -> None:
        self.total = None

    def add(
        self,
        per_expert: torch.Tensor,
        tokens: int,
        dropped: torch.Tensor,
        losses: list[torch.Tensor],
        calls: float = 1.0,
    ) -> None:
        """One forward call's routing: `losses` = (aux, seq_aux, z), zero where off; `calls` this
        rank's share of the call (1/shards when sequence shards split it)."""
        one, device = (
            torch.ones(1, dtype=torch.float64, device=per_expert.device),
            per_expert.device,
        )
        row = torch.cat(
            [per_expert.double(), one * calls, one * tokens, dropped.double().view(1)]
            + [loss.detach().double().view(1).to(device) for loss in losses]
        )
        self.total = row if self.total is None else self.total + row

    def as_tensor(self) -> torch.Tensor:
        """[per_expert..., calls, tokens, dropped, aux sum, seq_aux sum, z sum] (float64, on the device;
        zeros before any call)."""
        if self.total is None:
            return torch.zeros(self.num_experts + len(self.FIELDS), dtype=torch.float64)
        return self.total


class MoE(nn.Module):
    """The MoE feed-forward of one block: route, dispatch to the experts, add the shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.cfg = moe
        self.router = Router(cfg)
        self.experts = Experts(moe.num_experts, cfg.d_model, moe.expert_ffn_size(cfg))
        hidden = moe.shared_ffn_size(cfg)
        self.shared = SharedExperts(cfg.d_model, hidden, moe.shared_expert_gate) if hidden else None
        self.dispatch: Dispatch = LocalDispatch()
        # the weight of this micro-batch in the step's loss (set by the trainer)
        self.aux_grad_scale = 1.0
        self.stats = RoutingStats(moe.num_experts)
        # sequence parallelism sets its tensor-parallel group
        self.shards: TokenShards = WholeSequences()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        out = self.dispatch(flat, routing, self.experts)
        aux = self._aux_loss(routing, sequences=shape[0])
        if aux is not None and torch.is_grad_enabled():
            out = AuxLossGrad.apply(out, aux, self.aux_grad_scale * self.shards.loss_weight)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)

    def _aux_loss(self, routing: Routing, sequences: int) -> torch.Tensor | None:
        """The weighted sum of the enabled auxiliary losses (None when all are off), recording
        each one's value and the routing counts in `stats`. Split over sequence shards, this rank's
        share: the shares' sum is the loss of the whole micro-batch."""
        moe, E, shards = self.cfg, self.router.num_experts, self.shards
        experts = routing.experts
        zero = torch.zeros((), device=experts.device)
        aux = load_balancing_loss(routing, E, shards) if moe.aux_loss_coef > 0 else zero
        seq = (
            sequence_balance_loss(routing, E, sequences, shards)
            if moe.seq_aux_loss_coef > 0
            else zero
        )
        z = zero
        if moe.z_loss_coef > 0:
            z = routing.logits.logsumexp(dim=-1).square().sum() / (experts.shape[0] * shards.size)
        kept = experts.flatten() if routing.kept is None else experts[routing.kept]
        dropped = zero if routing.kept is None else (~routing.kept).sum()
        per_expert = torch.bincount(kept, minlength=E)
        self.stats.add(per_expert, experts.shape[0], dropped, [aux, seq, z], calls=1 / shards.size)
        weighted = [(moe.aux_loss_coef, aux), (moe.seq_aux_loss_coef, seq), (moe.z_loss_coef, z)]
        terms = [c * loss for c, loss in weighted if c > 0]
        return torch.stack(terms).sum() if terms else None


class TokenShards(Protocol):
    """The ranks a micro-batch's tokens are split over along the sequence (tensor parallelism's
    sequence parallelism, context parallelism): how many, and a sum over them of a tensor of counts
    (no gradient). `loss_weight`: what this rank's share of an auxiliary loss is multiplied by in
    backward, so the shares' gradients add up to the whole loss's once the data-parallel average
    (which counts context-parallel ranks, but not tensor-parallel ones) has divided them."""

    size: int
    loss_weight: int

    def sum(self, counts: torch.Tensor) -> torch.Tensor: ...


class WholeSequences:
    """Every token of the micro-batch on this rank."""

    size = 1
    loss_weight = 1

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


def load_balancing_loss(
    routing: Routing, num_experts: int, shards: TokenShards | None = None
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers computes it for Mixtral and
    Qwen3-MoE: E · Σ_e f_e · P_e, f_e the fraction of tokens with e among their top-k choices (so Σ f
    = k), P_e the mean softmax probability of e. Balanced routing gives k; one expert for all, E·k.
    Over sequence `shards`, f counts every shard's tokens and this rank adds its tokens' part of P
    (Megatron-core's rule), so the shards' losses sum to the whole micro-batch's."""
    shards = shards or WholeSequences()
    total = routing.experts.shape[0] * shards.size
    f = shards.sum(torch.bincount(routing.experts.flatten(), minlength=num_experts)).float() / total
    return num_experts * (f * routing.logits.softmax(dim=-1).sum(dim=0) / total).sum()


def sequence_balance_loss(
    routing: Routing, num_experts: int, sequences: int, shards: TokenShards | None = None
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the sequences:
    Σ_e f_e · P_e per sequence, f_e = E/(k·T) · (tokens choosing e), P_e the mean of the token's
    normalised scores s_e / Σ s (over sequence `shards`, as `load_balancing_loss`)."""
    shards = shards or WholeSequences()
    tokens, k = routing.experts.shape
    per_seq = tokens // sequences
    whole = per_seq * shards.size
    seq_of = torch.arange(tokens, device=routing.experts.device).div(per_seq, rounding_mode="floor")
    slots = (seq_of.unsqueeze(1) * num_experts + routing.experts).flatten()
    counts = shards.sum(torch.bincount(slots, minlength=sequences * num_experts)).view(
        sequences, num_experts
    )
    f = counts.float() * num_experts / (k * whole)
    scores = routing.scores / routing.scores.sum(dim=-1, keepdim=True)
    p = scores.view(sequences, per_seq, num_experts).sum(dim=1) / whole
    return (f * p).sum(dim=1).mean()


@torch.no_grad()
def update_expert_bias(layer: MoE, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, applied after the optimizer step: every expert's
    bias moves by `rate` toward balance, up when its load is below the mean, down when above. `load`
    is the step's assignments per expert over the whole batch (the same on every rank)."""
    bias = layer.router.expert_bias
    assert bias is not None
    bias += rate * torch.sign(load.mean() - load).to(bias.dtype).to(bias.device)
