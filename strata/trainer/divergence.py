"""Guards against committing a diverged run: the error that ends a run whose loss or gradient norm
stays non-finite (`train.nonfinite`), the loss-spike guard, which drops the update of a step
whose loss or gradient norm lies far above its recent history (a step hook of the loop), and the
check that refuses to save weights that are finite but implausibly large (`implausible_weights`).

The spike guard follows OLMo-core's skip-step optimizer: a step is a spike when its loss or its
gradient norm exceeds the mean of the last `train.spike_window` accepted steps by `train.spike_sigma`
standard deviations (6 by default, as OLMo-core), once `train.spike_min_steps` steps are known.
Megatron-LM's `--check-for-spiky-loss` flags a loss above 10x the largest recent one and reruns the
step to tell a hardware fault from the data; without spare hardware to rerun on, Strata skips the
update as OLMo does, and ends the run after `train.max_spike_steps` spikes in a row, before any save
of the state they led to. The statistics start afresh after a resume.

Every rank sees the same loss and gradient norm (agreed by one all-reduce in the trainer), so every
rank makes the same decision.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from strata.config import TrainConfig
from strata.errors import StrataError
from strata.parallel import comm
from strata.trainer.hooks import StepHook


class DivergedError(StrataError):
    """The run diverged: spikes in a row, or weights too large to save; nothing of it was saved."""


class NonFiniteError(StrataError):
    """Training diverged: the loss or gradient norm stayed NaN/inf (see `train.nonfinite`)."""


def nonfinite_error(
    train: TrainConfig, in_a_row: int, step: int, loss: float, grad_norm: float, resume: Path
) -> NonFiniteError | None:
    """The error that ends the run after step `step`, the `in_a_row`-th non-finite one in a row,
    once `train.nonfinite` says it cannot go on (else None); `resume` is the checkpoint directory
    to resume from."""
    if train.nonfinite == "skip" and in_a_row < train.max_nonfinite_steps:
        return None
    why = (
        "train.nonfinite=stop"
        if train.nonfinite == "stop"
        else f"{in_a_row} steps in a row, train.max_nonfinite_steps={train.max_nonfinite_steps}"
    )
    return NonFiniteError(
        f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not "
        f"finite ({why}); "
        "training stopped and this state was not saved. Resume from the newest committed "
        "checkpoint with "
        f"--resume {resume} and a lower optim.lr (or a longer "
        "optim.warmup_steps, or "
        "optim.grad_clip > 0)"
    )


@dataclass
class SpikeGuard(StepHook):
    """Running statistics of accepted steps' loss and gradient norm, and the spike decision; as the
    loop's step hook, it vetoes a spike's update and ends the run after `max_in_a_row` in a row."""

    sigma: float
    window: int
    min_steps: int
    max_in_a_row: int = 0  # spikes in a row that end the run (0: never)
    checkpoint_dir: Path | None = None  # the one to resume from, named when the run ends
    losses: deque[float] = field(default_factory=deque)
    norms: deque[float] = field(default_factory=deque)
    last_spike_step: int = -1  # the newest step judged a spike (-1: none yet)
    in_a_row: int = 0
    spike: str | None = None  # why the step in progress is a spike (None: it is not, or not judged)

    @classmethod
    def from_config(cls, train: TrainConfig, checkpoint_dir: Path) -> SpikeGuard | None:
        """The guard `train` asks for, or None when spike_sigma is 0."""
        if not train.spike_sigma:
            return None
        return cls(
            train.spike_sigma,
            train.spike_window,
            train.spike_min_steps,
            train.max_spike_steps,
            checkpoint_dir,
        )

    def start_step(self, step: int) -> None:
        """A new step is no spike until judged one."""
        self.spike = None

    def veto(self, step: int, loss: float, grad_norm: float) -> str | None:
        """ "loss spike: ..." when step `step` is a spike (`judge`): its update is dropped."""
        self.spike = self.judge(step, loss, grad_norm)
        return None if self.spike is None else f"loss spike: {self.spike}"

    def stop(self, step: int) -> DivergedError | None:
        """The error once `max_in_a_row` steps in a row were spikes: the run diverged, and none of
        the state those steps led to is saved (their updates were dropped)."""
        limit = self.max_in_a_row
        if self.spike is None or not limit or self.in_a_row < limit:
            return None
        return DivergedError(
            f"step {step}: {limit} steps in a row were loss spikes, the last one's {self.spike}: "
            "the run diverged, and training stopped (their updates were dropped, nothing of them "
            "was saved). Resume from the newest committed checkpoint with --resume "
            f"{self.checkpoint_dir} and a lower optim.lr (or a longer optim.warmup_steps); "
            "train.spike_sigma sets how far above its history a step may go"
        )

    def suspect(self, step: int) -> bool:
        """`unstable_since(step)`."""
        return self.unstable_since(step)

    def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
        """Why step `step` (1-based) is a spike, or None: then its values join the history."""
        reason = _above(self.losses, loss, self.sigma, self.min_steps, "loss") or _above(
            self.norms, grad_norm, self.sigma, self.min_steps, "gradient norm"
        )
        if reason:
            self.last_spike_step, self.in_a_row = step, self.in_a_row + 1
            return reason
        self.in_a_row = 0
        for history, value in ((self.losses, loss), (self.norms, grad_norm)):
            history.append(value)
            if len(history) > self.window:
                history.popleft()
        return None

    def unstable_since(self, step: int) -> bool:
        """Whether a spike fell within the last `window` steps before `step`: a checkpoint saved now
        may hold a run on its way to diverging (retention keeps an older one besides)."""
        return self.last_spike_step >= 0 and step - self.last_spike_step < self.window


def _above(
    history: deque[float], value: float, sigma: float, min_steps: int, what: str
) -> str | None:
    """Why `value` lies more than `sigma` deviations above `history`'s mean (None if it does not)."""
    if len(history) < min_steps:
        return None
    mean = sum(history) / len(history)
    std = math.sqrt(sum((v - mean) ** 2 for v in history) / len(history))
    # a floor on the deviation: a history of equal values would make any rise a spike
    limit = mean + sigma * max(std, 1e-3 * abs(mean))
    if value <= limit:
        return None
    return (
        f"{what} {value:.4g} is above {limit:.4g} (mean {mean:.4g} + {sigma:g} x {std:.3g} over "
        f"{len(history)} steps)"
    )


def implausible_weights(
    params: Sequence[torch.Tensor], limit: float, group, step: int, checkpoint_dir: Path
) -> DivergedError | None:
    """The error that stops a run, saving nothing, when a parameter's magnitude exceeds `limit`
    (checkpoint.max_abs_weight; 0: no limit) on any rank (collective over `group`), else None:
    finite weights of 1e29 verify as sound and resume into garbage."""
    if not limit:
        return None
    held = [p.detach() for p in params if p.numel()]
    local = (
        max((float(n) for n in torch._foreach_norm(held, math.inf)), default=0.0) if held else 0.0
    )
    largest = torch.tensor([local if math.isfinite(local) else 0.0], dtype=torch.float64)
    comm.all_reduce(largest, group, dim="checkpoint", op=dist.ReduceOp.MAX)
    if largest.item() <= limit:
        return None
    return DivergedError(
        f"step {step}: a parameter reached magnitude {largest.item():.3g}, above "
        f"checkpoint.max_abs_weight={limit:g}: the run diverged, and this state was not saved. "
        f"Resume from the newest committed checkpoint with --resume {checkpoint_dir} and a lower "
        "optim.lr (or raise checkpoint.max_abs_weight if such weights are intended)"
    )
