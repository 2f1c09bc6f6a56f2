"""`Objective`: what a step's objective other than the next-token loss provides to the
`ParallelModel` that runs it (`train.objective`; `strata.trainer.preference`'s DPO is one): the
step's forward and backward, the evaluation of a micro-batch and the step's metrics. A protocol
here, below both, so that `parallelize` need not import the objectives built on it."""

from __future__ import annotations

from typing import Protocol

import torch

from strata.data.tokens import Batch


class Objective(Protocol):
    """A train.objective other than lm, which runs the step and the evaluation in its place."""

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """The step's gradients into the engine's buffers; this rank's share of its loss."""
        ...

    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's summed loss and its weight, as `ParallelModel.eval_loss`'s."""
        ...

    def record(self) -> dict[str, float]:
        """The last step's metrics for its record in metrics.jsonl."""
        ...
