"""Direct Preference Optimization (`train.objective: dpo`, Rafailov et al. 2023) as TRL's
DPOTrainer computes it, on the preference pairs `strata data prepare` packs.

A window of pairs holds conversations alternating chosen, rejected (`strata.data.sft`): its
conversations 2k and 2k+1 are pair k, each trained on its completion only. A target's conversation
is the number of end-of-document tokens before it in the window's inputs (a trained target is never
one, nor a conversation's first token), so the pairs are found from the batch alone.

Per pair, the policy's log-probabilities of the completion's trained targets are summed for the
chosen and the rejected side (logp_c, logp_r), and so are the reference's (ref_c, ref_r): the
same model with its LoRA adapters off (`strata.lora.adapters_off`), or without adapters (full
fine-tuning) the model as the run started: a copy of this rank's trained parameters taken before
any checkpoint is resumed (model.init_from's weights, or the initial values), swapped in for the
reference's pass. Either runs under no_grad on each micro-batch before the policy's pass. With
rewards r = beta·(logp − ref) (TRL's rewards/chosen and rewards/rejected), the loss of a pair is
TRL 1.16's

    sigmoid: −log σ(beta·((logp_c − ref_c) − (logp_r − ref_r)))
    ipo:     ((logp_c − ref_c)/n_c − (logp_r − ref_r)/n_r − 1/(2·beta))²   (n: completion tokens)

and the step's loss is their mean over every pair of the global batch: the pairs are counted over
the dp group before any backward, and each micro-batch's summed pair losses are scaled by
dp/count, so the engine's 1/dp leaves the exact mean whatever the split over micro-batches and
ranks. Under tensor parallelism the log-probabilities come from the vocab-parallel cross-entropy.
Under context parallelism each rank sums its shard of every completion, and the sums are added
over the cp group (identity backward: each rank's shard gets the whole sum's gradient); the pairs
are counted on the whole sequences, which the cp ranks of a replica share. Under pipeline
parallelism the reference's per-target log-probabilities come from a forward pass through the
stages per micro-batch (`Pipeline.evaluate`, adapters off) and travel to the last stage as a
channel of the targets, (rows, seq, 3): target id, slot, reference log-probability (the schedule
cuts the targets into micro-batches along dim 0, as the inputs); the last stage computes the pair
losses there, each micro-batch's times dp·M/count (the engine applies 1/(dp·M)).

The step also reports TRL's rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward
above the rejected one), rewards/margins and logps/chosen, logps/rejected, each the mean over the
global batch's pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from strata.config.schema import DpoConfig
from strata.data.tokens import Batch
from strata.errors import DataError
from strata.lora import adapters_off
from strata.model import IGNORE_INDEX
from strata.parallel import comm
from strata.trainer.parallelize import ParallelModel

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_slots(inputs: torch.Tensor, targets: torch.Tensor, eot: int) -> torch.Tensor:
    """For each target of a (rows, seq) micro-batch, flat: its slot (row·seq + pair)·2 + side
    (0 chosen, 1 rejected), or −1 where it is not trained (IGNORE_INDEX)."""
    rows, seq = inputs.shape
    conversation = torch.cumsum(inputs == eot, dim=1)  # end-of-document tokens up to the input
    row = torch.arange(rows, device=inputs.device).unsqueeze(1)
    slot = (row * seq + conversation // 2) * 2 + conversation % 2
    return torch.where(targets != IGNORE_INDEX, slot, -1).flatten()


def pair_sums(values: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """`values` (flat, per target) summed per slot: (slots/2, 2), chosen and rejected."""
    kept = slots >= 0
    total = torch.zeros(size, dtype=values.dtype, device=values.device)
    return total.index_add(0, slots[kept], values[kept]).view(-1, 2)


def dpo_losses(
    logps: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor, dpo: DpoConfig
) -> torch.Tensor:
    """Each pair's loss from the (pairs, 2) chosen/rejected log-probability sums of the policy and
    the reference and the completions' token counts (TRL 1.16's sigmoid and ipo)."""
    ratios = logps - ref
    if dpo.loss_type == "ipo":  # TRL averages each side over its completion's tokens
        average = ratios / tokens.clamp(min=1.0)
        return (average[:, 0] - average[:, 1] - 1 / (2 * dpo.beta)) ** 2
    return -F.logsigmoid(dpo.beta * (ratios[:, 0] - ratios[:, 1]))


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the cp group forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        """The shards' partial sums added."""
        return comm.all_reduce(x.contiguous().clone(), group, dim="cp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        """Each shard's partial sum gets the whole sum's gradient."""
        return grad, None


class Preference:
    """The DPO step and evaluation on a `ParallelModel` (set as its `objective`): see the module
    docstring. `eot` is the data's end-of-document token."""

    def __init__(self, model: ParallelModel, dpo: DpoConfig, eot: int, lora: bool):
        self.model, self.dpo, self.eot, self.lora = model, dpo, eot, lora
        self.raw = model.loss_fn.loss  # each target's cross-entropy (vocab-parallel under tp)
        # full fine-tuning: the trained parameters' values as the run started
        self.reference: list[torch.Tensor] | None = None

    def _trained_params(self) -> list[nn.Parameter]:
        """This rank's parameters that train, each once."""
        seen: dict[int, nn.Parameter] = {}
        for part in self.model.parts:
            for p in part.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def keep_reference(self) -> None:
        """Full fine-tuning: copy this rank's trained parameters as the reference model (called
        with the weights the run starts from, before any checkpoint is resumed)."""
        if not self.lora:
            self.reference = [p.detach().clone() for p in self._trained_params()]

    @contextlib.contextmanager
    def _reference_model(self) -> Iterator[None]:
        """Inside the block, the model computes as the reference (no gradient): its adapters off,
        or its trained parameters holding the values the run started from."""
        if self.lora:
            with torch.no_grad(), adapters_off(self.model.parts):
                yield
            return
        if self.reference is None:  # a run that resumed nothing: the weights are its first
            self.keep_reference()
        assert self.reference is not None
        params = self._trained_params()
        swap = list(zip(params, self.reference))
        for p, ref in swap:
            p.data, ref.data = ref.data, p.data
        try:
            with torch.no_grad():
                yield
        finally:
            for p, ref in swap:
                p.data, ref.data = ref.data, p.data
        self.stats = torch.zeros(len(METRICS) + 1, dtype=torch.float64)  # sums, then the pairs

    def _pairs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's targets of the micro-batch (IGNORE_INDEX where untrained) and their slots,
        on the device, and the trained targets of each (row, pair) slot on the whole sequences,
        (slots/2, 2)."""
        model = self.model
        whole = model._trained(batch).to(model.device)
        slots = pair_slots(batch.inputs.to(model.device), whole, self.eot)
        ones = torch.ones(slots.shape, dtype=torch.float32, device=model.device)
        tokens = pair_sums(ones, slots, 2 * batch.inputs.numel())
        return model.local(whole), model.local(slots.view(whole.shape)).flatten(), tokens

    def _logps(self, batch: Batch, targets: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The model's per-slot sums of its targets' log-probabilities, (slots/2, 2)."""
        model = self.model
        logits = model.run(model.parts[0], batch.inputs)
        per_target = -self.raw(logits, targets, reduction="none").float()
        sums = pair_sums(per_target, slots, 2 * batch.inputs.numel())
        if model.topo.layout.cp > 1:  # each rank holds a shard of every completion
            sums = _SumOverGroup.apply(sums, model.topo.group("cp"))
        return sums

    def _pair_losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's pair losses (with autograd through the policy) and the detached
        per-pair figures behind the metrics (pairs, len(METRICS))."""
        targets, slots, tokens = self._pairs(batch)
        with self._reference_model():
            ref = self._logps(batch, targets, slots)
        return self._score(self._logps(batch, targets, slots), ref, tokens)

    def _score(
        self, logps: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair losses and figures (`_pair_losses`) from the per-slot sums (slots/2, 2) of
        the policy, the reference and the trained targets."""
        held = (tokens > 0).all(dim=1)
        logps, ref, tokens = logps[held], ref[held], tokens[held]
        losses = dpo_losses(logps, ref, tokens, self.dpo)
        rewards = self.dpo.beta * (logps.detach() - ref)
        figures = torch.stack(
            [
                rewards[:, 0],
                rewards[:, 1],
                (rewards[:, 0] > rewards[:, 1]).float(),
                rewards[:, 0] - rewards[:, 1],
                logps[:, 0].detach(),
                logps[:, 1].detach(),
            ],
            dim=1,
        )
        return losses, figures

    def _count(self, held: int) -> int:
        """The global batch's pairs from this rank's `held`, over the dp group (the same number on
        every rank), whose cp ranks count their replica's pairs alike."""
        model = self.model
        total = torch.tensor(held, dtype=torch.int64, device=model.device)
        count = int(comm.all_reduce(total, model.topo.group("dp"), dim="dp").item())
        count //= model.topo.layout.cp
        if count == 0:
            raise DataError(
                "a global batch holds no preference pair with both completions trained, so its "
                "DPO loss divides by zero; `strata data prepare` drops such pairs, so this data "
                "was written otherwise: prepare it again"
            )
        return count

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """`ParallelModel.forward_backward` for DPO: gradients of the mean pair loss over the
        global batch into the engine's buffers; returns this rank's share of the loss (summed over
        the dp ranks, the step's). Also gathers the step's metrics (`record`)."""
        model = self.model
        offloader = model.tiers.activations if model.tiers else None
        with model.autocast(), offloader.saving() if offloader else contextlib.nullcontext():
            if model.pipeline is not None:
                loss = self._pipeline_step(micro_batches)
            else:
                loss = self._plain_step(micro_batches)
        if offloader:
            offloader.end_step()
        return loss

    def _plain_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """`forward_backward` without pipeline parallelism: reference and policy per micro-batch,
        each micro-batch's summed pair losses times dp/count."""
        model = self.model
        held = sum(int((self._pairs(b)[2] > 0).all(dim=1).sum()) for b in micro_batches)
        weight = model.topo.dp_size / self._count(held)
        model.engine.expect_backwards(len(micro_batches))
        loss_sum = torch.zeros((), device=model.device)
        sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=model.device)
        for batch in micro_batches:
            losses, figures = self._pair_losses(batch)
            loss = losses.sum() * weight
            loss.backward()
            loss_sum += loss.detach()
            sums += torch.cat([figures.double().sum(dim=0), sums.new_tensor([len(losses)])])
        # (the cp ranks of a replica count its pairs alike: the means are unchanged)
        self.stats = comm.all_reduce(sums, model.topo.group("dp"), dim="dp").cpu()
        return loss_sum / model.topo.layout.cp  # the loop sums it over the dp group, cp ranks too

    # --- under pipeline parallelism ---------------------------------------------------------
    @contextlib.contextmanager
    def _stage_loss(self, loss: Callable[..., torch.Tensor], weight: float | None) -> Iterator:
        """The pipeline's loss function (the model's `StepLoss`, which the schedule holds) computes
        `loss` inside the block."""
        step_loss = self.model.loss_fn
        kept = step_loss.loss, step_loss.weight
        step_loss.loss, step_loss.weight = loss, weight
        try:
            yield
        finally:
            step_loss.loss, step_loss.weight = kept

    def _stage_logps(self, batch: Batch, targets: torch.Tensor) -> torch.Tensor:
        """Each target's log-probability (rows, seq) by a forward-only pass through the pipeline,
        on the last stage (zeros elsewhere)."""
        model, pipeline = self.model, self.model.pipeline
        assert pipeline is not None
        out = torch.zeros(targets.shape, dtype=torch.float64, device=model.device)

        def capture(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            per_target = -self.raw(logits, targets, reduction="none")
            out.copy_(per_target.view(targets.shape))
            return torch.zeros((), device=model.device)

        inputs = model.local(batch.inputs)
        with self._stage_loss(capture, None):
            pipeline.evaluate(inputs, targets, model.documents_of(batch.inputs))
        return out

    def _packed(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """The micro-batch's targets as the pipeline's last stage needs them, (rows, seq, 3)
        float64: the target id (IGNORE_INDEX where untrained), its slot, the reference's
        log-probability of it (computed here, adapters off); and its pairs."""
        targets, slots, tokens = self._pairs(batch)
        with self._reference_model():
            ref = self._stage_logps(batch, targets)
        packed = torch.stack([targets.double(), slots.view(targets.shape).double(), ref], dim=-1)
        return packed, int((tokens > 0).all(dim=1).sum())

    def _packed_losses(self, logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The last stage's pair losses of a micro-batch from its logits and `_packed` targets;
        their figures are added to `self._sums`."""
        targets, slots, ref = packed[..., 0].long(), packed[..., 1].long().flatten(), packed[..., 2]
        size = 2 * targets.numel()
        per_target = -self.raw(logits, targets, reduction="none").float()
        ones = (slots >= 0).float()
        losses, figures = self._score(
            pair_sums(per_target, slots, size),
            pair_sums(ref.flatten().float(), slots, size),
            pair_sums(ones, slots, size),
        )
        self._sums += torch.cat([figures.double().sum(dim=0), self._sums.new_tensor([len(losses)])])
        return losses

    def _pipeline_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """`forward_backward` under pipeline parallelism: the reference's log-probabilities by a
        forward pass per micro-batch, carried to the last stage inside the targets (the schedule
        cuts them into micro-batches as it cuts the inputs), where the pair losses are computed,
        each micro-batch's times dp·M/count (the engine applies 1/(dp·M))."""
        model, pipeline = self.model, self.model.pipeline
        assert pipeline is not None
        packed = [self._packed(batch) for batch in micro_batches]
        weight = model.topo.dp_size * pipeline.microbatches / self._count(sum(n for _, n in packed))
        self._sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=model.device)
        model.engine.expect_backwards(pipeline.microbatches)
        inputs = torch.cat([b.inputs for b in micro_batches])
        with self._stage_loss(lambda x, y, reduction: self._packed_losses(x, y).sum(), weight):
            loss = pipeline.forward_backward(
                model.local(inputs),
                torch.cat([p for p, _ in packed]),
                model.documents_of(inputs),
            )
        stats = comm.all_reduce(self._sums, model.topo.group("dp"), dim="dp")
        self.stats = comm.all_reduce(stats, pipeline.group, dim="pp").cpu()  # the last stage's
        return loss

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`ParallelModel.eval_loss` for DPO: (the micro-batch's summed pair losses, its pairs),
        float64 0-d tensors on the device; summed over micro-batches and ranks, the first over
        the second is the mean pair loss."""
        model = self.model
        with model.autocast():
            if model.pipeline is None:
                losses, _ = self._pair_losses(batch)
            else:
                losses = self._stage_eval(batch)
        loss, pairs = losses.double().sum(), torch.tensor(float(len(losses)), dtype=torch.float64)
        pairs = pairs.to(model.device)
        if model.pipeline is not None:  # the last stage's, on every pipeline rank
            both = comm.all_reduce(torch.stack([loss, pairs]), model.pipeline.group, dim="pp")
            loss, pairs = both[0], both[1]
        return loss, pairs

    def _stage_eval(self, batch: Batch) -> torch.Tensor:
        """The micro-batch's pair losses by forward passes through the pipeline: on its last
        stage (none elsewhere)."""
        pipeline = self.model.pipeline
        assert pipeline is not None
        targets, slots, tokens = self._pairs(batch)
        with self._reference_model():
            ref = self._stage_logps(batch, targets)
        logps = self._stage_logps(batch, targets)
        if not pipeline.has_last:
            return torch.zeros(0, device=self.model.device)
        size = 2 * targets.numel()
        sums = [pair_sums(x.flatten().float(), slots, size) for x in (logps, ref)]
        losses, _ = self._score(sums[0], sums[1], tokens)
        return losses

    def record(self) -> dict[str, float]:
        """The last step's metrics: each the mean over the global batch's pairs."""
        pairs = float(self.stats[-1])
        return {name: float(self.stats[i]) / max(pairs, 1.0) for i, name in enumerate(METRICS)}
