"""Pipeline parallelism: the GPT's layer stack cut into pp·V stages, balanced by layers (the
embedding rides on the first stage, the final norm, output layer and loss on the last), run by a
`torch.distributed.pipelining` schedule. Each rank holds V stages: stages r, r+P, … for the
looped/interleaved schedules, or r and 2P−1−r for the V-shaped zero-bubble ones.

Stages hold the model's own modules under their original names, so a stage's state_dict keys are
the unsharded model's and checkpoints stay in the global layout. Packed documents' boundaries and
positions reach every stage as keyword arguments of the schedule's step, which it cuts into
micro-batches like the inputs and hands to each stage (the hidden states alone travel between ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from strata.config.vocabulary import SINGLE_STAGE_SCHEDULES
from strata.model import GPT, Documents
from strata.parallel import comm
from strata.parallel.stages import StagePlan, plan_stages, schedule_name, stage_indices
from strata.parallel.watchdog import collective

SCHEDULES = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    "looped_bfs": pipelining.ScheduleLoopedBFS,
    "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": pipelining.ScheduleZBVZeroBubble,
    "dualpipev": pipelining.ScheduleDualPipeV,
}


class Stage(nn.Module):
    """One pipeline stage of a GPT, holding the model's own modules under their original names."""

    def __init__(self, model: GPT, plan: StagePlan):
        super().__init__()
        self.plan = plan
        if plan.is_first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in plan.layers})
        if plan.is_last:
            self.norm, self.output = model.norm, model.output
        rope_cos, rope_sin = model.rope_cos, model.rope_sin  # the GPT's buffers
        assert isinstance(rope_cos, torch.Tensor) and isinstance(rope_sin, torch.Tensor)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        doc_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.plan.is_first:
            x = self.tok_embeddings(x)
        cos, sin = cast(torch.Tensor, self.rope_cos), cast(torch.Tensor, self.rope_sin)
        documents = None
        if doc_ids is not None or doc_positions is not None:
            documents = Documents(doc_ids, doc_positions)
            cos, sin = documents.rotary(cos, sin)
        for layer in self.layers.values():
            x = layer(x, cos, sin, documents)
        if self.plan.is_last:
            x = self.output(self.norm(x))
        return x


def split_stages(
    model: GPT, pp_rank: int, pp: int, virtual_stages: int, schedule: str
) -> list[Stage]:
    """This pipeline rank's stages of `model`, in execution order (on the model's device, which
    may be meta: materialise them before building the `Pipeline`)."""
    plans = plan_stages(
        model.cfg.n_layers,
        pp * virtual_stages,
        stage_indices(pp_rank, pp, virtual_stages, schedule_name(schedule, virtual_stages)),
    )
    return [Stage(model, plan) for plan in plans]


@dataclass(frozen=True)
class StageShapes:
    """Shapes of one micro-batch at the stage boundaries: token ids into the first stage, the
    hidden states between stages, the logits out of the last."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    logits: tuple[int, ...]
    logits_dtype: torch.dtype = torch.float32

    def stage_args(self, plan: StagePlan, device: torch.device) -> dict:
        """PipelineStage's input_args/output_args for a stage (static metadata: no inference run)."""
        # requires_grad marks what carries a gradient back (torch derives the backward metadata from
        # it)
        hidden = torch.empty(self.hidden, device=device, requires_grad=True)
        inputs = (
            torch.empty(self.tokens, dtype=torch.long, device=device) if plan.is_first else hidden
        )
        outputs = (
            torch.empty(self.logits, dtype=self.logits_dtype, device=device, requires_grad=True)
            if plan.is_last
            else hidden
        )
        return {"input_args": (inputs,), "output_args": (outputs,)}


class Pipeline:
    """This rank's stages of the model and the schedule that runs one step over them. The stages get
    static boundary metadata from `shapes` (torch would otherwise infer it by running a real
    forward/backward, which the ZeRO engine's gradient hooks would take for a step)."""

    def __init__(
        self,
        parts: list[Stage],
        loss_fn,
        group,
        pp: int,
        virtual_stages: int,
        schedule: str,
        microbatches: int,
        device: torch.device,
        tied_group,
        shapes: StageShapes,
    ):
        self.group, self.microbatches, self.parts = group, microbatches, parts
        self.name = schedule_name(schedule, virtual_stages)
        num_stages = pp * virtual_stages
        self.has_first = any(p.plan.is_first for p in parts)
        self.has_last = any(p.plan.is_last for p in parts)
        # A tied embedding lives on the first and the last stage; when those are different ranks,
        # each holds a copy whose gradients the engine sums over `tied_group` (Megatron's embedding
        # group).
        self.tied_weight = None
        if tied_group is not None and self.has_first != self.has_last:
            edge = next(p for p in parts if p.plan.is_first or p.plan.is_last)
            self.tied_weight = edge.tok_embeddings.weight if self.has_first else edge.output.weight
        stages = [
            pipelining.PipelineStage(
                part,
                part.plan.index,
                num_stages,
                device,
                group=group,
                **shapes.stage_args(part.plan, device),
            )
            for part in parts
        ]
        # Gradients are averaged over micro-batches by the engine, not by the schedule: its
        # scale_grads divides per stage, so a tied embedding held by two local stages would be
        # divided twice.
        cls = SCHEDULES[self.name]
        self.schedule = cls(
            stages[0] if self.name in SINGLE_STAGE_SCHEDULES else stages,
            n_microbatches=microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        self._loss_fn = loss_fn
        self._stage_owner = {
            s: dist.get_global_rank(group, r)
            for r in range(pp)
            for s in stage_indices(r, pp, virtual_stages, self.name)
        }
        self._num_stages = num_stages

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """One step over `microbatches` equal chunks of the batch (and of its `documents`; targets
        not trained are IGNORE_INDEX, which the loss skips); the gradients of the summed
        micro-batch losses go to the ZeRO engine's hooks (which apply the 1/M and sum the tied
        copies). Returns the mean micro-batch loss, on every pipeline rank."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        with collective("pipeline schedule (stage sends and receives)", "pp"):
            self.schedule.step(*args, **kwargs, **_stage_kwargs(documents))
        loss = (
            torch.stack(losses).mean().detach() if losses else torch.zeros((), device=inputs.device)
        )
        return comm.all_reduce(loss.float(), self.group, dim="pp")

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """The loss function's value on one micro-batch, forward only, on every pipeline rank.
        Runs the stages in order with plain send/recv (every rank walks the same stage sequence,
        so it cannot deadlock): evaluation needs no schedule, and its micro-batch count need not
        be M."""
        x, loss = inputs, torch.zeros((), device=inputs.device)
        for s in range(self._num_stages):
            me = self._stage_owner[s] == dist.get_rank()
            if me and s > 0:
                prev = self._stage_owner[s - 1]
                if prev != dist.get_rank():
                    x = comm.recv_tensor(prev, inputs.device, dim="pp")
            if me:
                x = next(p for p in self.parts if p.plan.index == s)(x, **_stage_kwargs(documents))
                if s == self._num_stages - 1:
                    loss = self._loss_fn(x, targets).float()
                else:
                    nxt = self._stage_owner[s + 1]
                    if nxt != dist.get_rank():
                        comm.send_tensor(x, nxt, dim="pp")
        return comm.all_reduce(loss, self.group, dim="pp")


def _stage_kwargs(documents: Documents | None) -> dict[str, torch.Tensor]:
    """`Stage.forward`'s keyword arguments for a batch's packed documents (none without them)."""
    if documents is None:
        return {}
    kwargs = {"doc_ids": documents.ids, "doc_positions": documents.positions}
    return {k: v for k, v in kwargs.items() if v is not None}
