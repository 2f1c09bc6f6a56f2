"""Direct Preference Optimization (`train.objective: dpo`, Rafailov et al. 2023) as TRL's
DPOTrainer computes it, on the preference pairs `strata data prepare` packs.

A window of pairs holds conversations alternating chosen, rejected (`strata.data.sft`): its
conversations 2k and 2k+1 are pair k, each trained on its completion only. A target's conversation
is the number of end-of-document tokens before it in the window's inputs (a trained target is never
one, nor a conversation's first token), so the pairs are found from the batch alone.

Per pair, the policy's log-probabilities of the completion's trained targets are summed for the
chosen and the rejected side (logp_c, logp_r), and so are the reference's (ref_c, ref_r): the
same model with its LoRA adapters off (`strata.lora.adapters_off`), run under no_grad on each
micro-batch before the policy's pass. With rewards r = beta·(logp − ref) (TRL's rewards/chosen and
rewards/rejected), the loss of a pair is TRL 1.16's

    sigmoid: −log σ(beta·((logp_c − ref_c) − (logp_r − ref_r)))
    ipo:     ((logp_c − ref_c)/n_c − (logp_r − ref_r)/n_r − 1/(2·beta))²   (n: completion tokens)

and the step's loss is their mean over every pair of the global batch: the pairs are counted over
the dp group before any backward, and each micro-batch's summed pair losses are scaled by
dp/count, so the engine's 1/dp leaves the exact mean whatever the split over micro-batches and
ranks. Under tensor parallelism the log-probabilities come from the vocab-parallel cross-entropy.
Under context parallelism each rank sums its shard of every completion, and the sums are added
over the cp group (identity backward: each rank's shard gets the whole sum's gradient); the pairs
are counted on the whole sequences, which the cp ranks of a replica share.
The step also reports TRL's rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward
above the rejected one), rewards/margins and logps/chosen, logps/rejected, each the mean over the
global batch's pairs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

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
        return comm.all_reduce(x.contiguous().clone(), group, dim="cp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class Preference:
    """The DPO step and evaluation on a `ParallelModel` (set as its `objective`): see the module
    docstring. `eot` is the data's end-of-document token."""

    def __init__(self, model: ParallelModel, dpo: DpoConfig, eot: int):
        self.model, self.dpo, self.eot = model, dpo, eot
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
        per_target = -model.loss_fn.loss(logits, targets, reduction="none").float()
        sums = pair_sums(per_target, slots, 2 * batch.inputs.numel())
        if model.topo.layout.cp > 1:  # each rank holds a shard of every completion
            sums = _SumOverGroup.apply(sums, model.topo.group("cp"))
        return sums

    def _pair_losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's pair losses (with autograd through the policy) and the detached
        per-pair figures behind the metrics (pairs, len(METRICS))."""
        targets, slots, tokens = self._pairs(batch)
        with torch.no_grad(), adapters_off(self.model.parts):
            ref = self._logps(batch, targets, slots)
        logps = self._logps(batch, targets, slots)
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

    def _count(self, micro_batches: list[Batch]) -> int:
        """The global batch's pairs, over the dp group (the same number on every rank), whose cp
        ranks count their replica's pairs alike."""
        held = torch.zeros((), dtype=torch.int64, device=self.model.device)
        for batch in micro_batches:
            _, _, tokens = self._pairs(batch)
            held += (tokens > 0).all(dim=1).sum()
        count = int(comm.all_reduce(held, self.model.topo.group("dp"), dim="dp").item())
        count //= self.model.topo.layout.cp
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
        weight = model.topo.dp_size / self._count(micro_batches)
        offloader = model.tiers.activations if model.tiers else None
        model.engine.expect_backwards(len(micro_batches))
        loss_sum = torch.zeros((), device=model.device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=model.device)
        pairs = 0
        with model.autocast(), offloader.saving() if offloader else contextlib.nullcontext():
            for batch in micro_batches:
                losses, figures = self._pair_losses(batch)
                loss = losses.sum() * weight
                loss.backward()
                loss_sum += loss.detach()
                sums += figures.double().sum(dim=0)
                pairs += len(losses)
        if offloader:
            offloader.end_step()
        stats = torch.cat([sums, torch.tensor([float(pairs)], device=model.device).double()])
        # (the cp ranks of a replica count its pairs alike: the means are unchanged)
        self.stats = comm.all_reduce(stats, model.topo.group("dp"), dim="dp").cpu()
        return loss_sum / model.topo.layout.cp  # the loop sums it over the dp group, cp ranks too

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`ParallelModel.eval_loss` for DPO: (the micro-batch's summed pair losses, its pairs),
        float64 0-d tensors on the device; summed over micro-batches and ranks, the first over
        the second is the mean pair loss."""
        with self.model.autocast():
            losses, _ = self._pair_losses(batch)
        pairs = torch.tensor(float(len(losses)), dtype=torch.float64, device=self.model.device)
        return losses.double().sum(), pairs

    def record(self) -> dict[str, float]:
        """The last step's metrics: each the mean over the global batch's pairs."""
        pairs = float(self.stats[-1])
        return {name: float(self.stats[i]) / max(pairs, 1.0) for i, name in enumerate(METRICS)}
