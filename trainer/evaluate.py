"""Evaluation on held-out data: the mean loss over the evaluation batches of a validation split
(`data.eval_batches`: its first eval_batches × micro_batch_size × dp sequences, or with 0 every
sequence once), each sequence weighing the same, summed over the data-parallel ranks whatever the
layout; and the line the console shows for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.parallel import comm
from strata.parallel.topology import Topology
from strata.trainer.data import Mixture, TokenDataset, eval_batches
from strata.trainer.parallelize import ParallelModel


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's mean loss, over how many sequences, and whether they were the whole split."""

    loss: float
    sequences: int
    whole: bool

    def line(self, step: int) -> str:
        perplexity = f"{math.exp(self.loss):.2f}" if self.loss < 50 else "overflow"
        read = (
            f"all {self.sequences} sequences of the validation split"
            if self.whole
            else f"the validation split's first {self.sequences} sequences (train.eval_batches × "
            "micro_batch_size × dp; 0 reads all of it)"
        )
        return f"step {step}: eval loss {self.loss:.4f} (perplexity {perplexity}) on {read}"


@torch.no_grad()
def evaluate(
    model: ParallelModel, dataset: TokenDataset | Mixture, batches: int, micro_batch: int, topo: Topology
) -> Evaluation:
    """`model`'s loss on `dataset`'s evaluation batches (`eval_batches`), in eval mode (collective
    over the data-parallel group). A shorter last micro-batch of the whole split counts for its
    sequences; a replica the split's end leaves without one adds nothing."""
    model.train(False)
    sums = torch.zeros(2, dtype=torch.float64, device=model.device)  # loss × sequences, sequences
    for inputs, targets in eval_batches(dataset, batches, micro_batch, topo.data_rank, topo.data_size):
        sums[0] += model.eval_loss(inputs, targets).double() * len(inputs)
        sums[1] += len(inputs)
    model.train(True)
    total, sequences = comm.all_reduce(sums, topo.group("dp"), dim="dp").tolist()
    # the dp group holds each replica's cp ranks, which read the same sequences
    return Evaluation(total / sequences, round(sequences / topo.layout.cp), batches == 0)
