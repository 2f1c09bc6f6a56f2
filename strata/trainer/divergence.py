"""Guards against committing a diverged run: the loss-spike guard, which drops the update of a step
whose loss or gradient norm lies far above its recent history, and the check that refuses to save
weights that are finite but implausibly large.

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
from dataclasses import dataclass, field

from strata.config import TrainConfig
from strata.errors import StrataError


class DivergedError(StrataError):
    """The run diverged: spikes in a row, or weights too large to save; nothing of it was saved."""


@dataclass
class SpikeGuard:
    """Running statistics of accepted steps' loss and gradient norm, and the spike decision."""

    sigma: float
    window: int
    min_steps: int
    losses: deque[float] = field(default_factory=deque)
    norms: deque[float] = field(default_factory=deque)
    last_spike_step: int = -1  # the newest step judged a spike (-1: none yet)
    in_a_row: int = 0

    @classmethod
    def from_config(cls, train: TrainConfig) -> SpikeGuard | None:
        """The guard `train` asks for, or None when spike_sigma is 0."""
        if not train.spike_sigma:
            return None
        return cls(train.spike_sigma, train.spike_window, train.spike_min_steps)

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
