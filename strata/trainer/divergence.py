"""Guards against committing a diverged run: the error that ends a run whose loss or gradient norm
stays non-finite (`train.nonfinite`), the loss-spike guard, which drops the update of a step
whose loss or gradient norm lies far above its recent history (a step hook of the loop), and the
check that refuses to save weights that are finite but implausibly large (`implausible_weights`).

The spike guard's rule. Its window holds the loss and gradient norm of each of the last
`train.spike_window` judged steps, spikes included: the weights do not move after a skipped
update, so a history of accepted steps alone would judge every later step against a past the
run can no longer return to, and one skip would lead to the next. The statistics are robust: the
median and the median absolute deviation (MAD, scaled by 1.4826 to a normal deviation), which a
minority of outliers hardly moves, so a single spike neither drags the threshold up (blinding the
guard to the next one) nor needs clipping, and a lasting level shift is the window's median once
it fills half the window: from then on it is no spike. A step is a spike when

- its loss exceeds the median by `train.spike_sigma` deviations (the deviation at least 1% of the
  median, so a flat history does not make noise a spike), or
- its gradient norm exceeds `train.spike_grad_ratio` times the median norm. Gradient clipping
  already bounds an update, and fine-tuning's gradient norm rises for a while as the model leaves
  its starting point, so the norm is judged only against a large factor, as Megatron-LM judges
  the loss (`--check-for-spiky-loss`: above 10x the recent maximum).

The guard watches once the learning-rate warm-up (`optim.warmup_steps`) has ended, when the loss
has left its steep initial fall, and judges once `train.spike_min_steps` steps after it are known.
OLMo-core's skip-step optimizer (a |z| above 6 over a rolling 128 steps, every step's value in
the window, judging after max(20, 64)) is the model; the mean and standard deviation it uses let
a few spikes widen the band enough that the next ones pass. Megatron-LM reruns a spiky step to
tell a hardware fault from the data; without spare hardware to rerun on, Strata skips the update
as OLMo does, and ends the run after `train.max_spike_steps` spikes in a row: the weights that
produced them are not saved (a save after a spike is refused) and the error names the newest
checkpoint saved before them. The guard's state is part of the training state (`state_dict`), so
a resumed run judges exactly as the uninterrupted run would have.

Every rank sees the same loss and gradient norm (agreed by one all-reduce in the trainer), so every
rank makes the same decision.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from strata.checkpoint import store
from strata.config import TrainConfig
from strata.errors import StrataError
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


MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its MAD
MIN_DEVIATION = 0.01  # the loss's deviation, at least this fraction of its median


@dataclass
class SpikeGuard(StepHook):
    """The rolling window of judged steps' loss and gradient norm, and the spike decision (the
    module's rule); as the loop's step hook, it vetoes a spike's update, refuses a save right after
    one, and ends the run after `max_in_a_row` in a row."""

    sigma: float
    window: int
    min_steps: int
    grad_ratio: float = 10.0  # a gradient norm above this many times the median is a spike (0: off)
    max_in_a_row: int = 0  # spikes in a row that end the run (0: never)
    watch_after: int = 0  # steps up to this one (the learning-rate warm-up) are not watched
    checkpoint_dir: Path | None = None  # where the checkpoint to resume from is, named at the end
    losses: deque[float] = field(default_factory=deque)
    norms: deque[float] = field(default_factory=deque)
    last_spike_step: int = -1  # the newest step judged a spike (-1: none yet)
    in_a_row: int = 0
    spike: str | None = None  # why the step in progress is a spike (None: it is not, or not judged)

    @classmethod
    def from_config(
        cls, train: TrainConfig, warmup_steps: int, checkpoint_dir: Path
    ) -> SpikeGuard | None:
        """The guard `train` asks for, watching after `warmup_steps`, or None when spike_sigma
        is 0."""
        if not train.spike_sigma:
            return None
        return cls(
            train.spike_sigma,
            train.spike_window,
            train.spike_min_steps,
            train.spike_grad_ratio,
            train.max_spike_steps,
            warmup_steps,
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
        the state those steps led to is saved (their updates were dropped, saves refused)."""
        limit = self.max_in_a_row
        if self.spike is None or not limit or self.in_a_row < limit:
            return None
        first = step - self.in_a_row + 1
        return DivergedError(
            f"step {step}: {limit} steps in a row were loss spikes, the last one's {self.spike}: "
            "the run diverged, and training stopped (their updates were dropped, nothing of them "
            f"was saved). {self._resume_hint(first)}, with a lower optim.lr (or a longer "
            "optim.warmup_steps); train.spike_sigma sets how far above its history a step may go"
        )

    def refuse_save(self, step: int) -> str | None:
        """Why the state after step `step` is not saved: that step was a spike, so the weights that
        produced it may be on their way to diverging (None: save)."""
        if self.spike is None:
            return None
        return f"step {step} was a loss spike, so the weights that produced it are not saved"

    def suspect(self, step: int) -> bool:
        """`unstable_since(step)`."""
        return self.unstable_since(step)

    def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
        """Why step `step` (1-based) is a spike, or None; its values join the window either way."""
        if step <= self.watch_after:
            return None
        reason = None
        if len(self.losses) >= self.min_steps:
            reason = _loss_spike(self.losses, loss, self.sigma) or _norm_spike(
                self.norms, grad_norm, self.grad_ratio
            )
        for history, value in ((self.losses, loss), (self.norms, grad_norm)):
            history.append(value)
            while len(history) > self.window:
                history.popleft()
        if reason:
            self.last_spike_step, self.in_a_row = step, self.in_a_row + 1
        else:
            self.in_a_row = 0
        return reason

    def unstable_since(self, step: int) -> bool:
        """Whether a spike fell within the last `window` steps before `step`: a checkpoint saved now
        may hold a run on its way to diverging (retention keeps an older one besides)."""
        return self.last_spike_step >= 0 and step - self.last_spike_step < self.window

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guard (rank 0's trainer state): the window and the count
        of spikes, so a resumed run judges as the uninterrupted one."""
        return {
            "losses": list(self.losses),
            "norms": list(self.norms),
            "last_spike_step": self.last_spike_step,
            "in_a_row": self.in_a_row,
        }

    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` returned (the newest `window` values of it)."""
        self.losses = deque(float(v) for v in state["losses"][-self.window :])
        self.norms = deque(float(v) for v in state["norms"][-self.window :])
        self.last_spike_step = int(state["last_spike_step"])
        self.in_a_row = int(state["in_a_row"])

    def _resume_hint(self, first_spike: int) -> str:
        """Which checkpoint to resume from: the newest committed one saved before step
        `first_spike` - 1, whose update led to the spikes."""
        root = self.checkpoint_dir
        if root is None:
            return "Start again"
        before = [p for p in store.committed(root) if _step_of(p) < first_spike - 1]
        if before:
            return f"Resume from the checkpoint saved before the spikes with --resume {before[-1]}"
        return (
            f"No checkpoint under {root} was saved before the spikes; start again (from scratch "
            "or model.init_from)"
        )


def _step_of(ckpt: Path) -> int:
    """The step a committed checkpoint holds (-1 when its marker cannot be read)."""
    try:
        return int(store.marker(ckpt)["step"])
    except (StrataError, KeyError, ValueError):
        return -1


def _loss_spike(history: deque[float], loss: float, sigma: float) -> str | None:
    """Why `loss` lies more than `sigma` robust deviations above `history`'s median, or None."""
    values = sorted(history)
    median = _median(values)
    mad = _median(sorted(abs(v - median) for v in values))
    deviation = max(MAD_TO_SIGMA * mad, MIN_DEVIATION * abs(median))
    limit = median + sigma * deviation
    if loss <= limit:
        return None
    return (
        f"loss {loss:.4g} is above {limit:.4g} (median {median:.4g} + {sigma:g} x {deviation:.3g} "
        f"over {len(values)} steps)"
    )


def _norm_spike(history: deque[float], norm: float, ratio: float) -> str | None:
    """Why gradient norm `norm` is more than `ratio` times `history`'s median, or None."""
    if not ratio:
        return None
    median = _median(sorted(history))
    if norm <= ratio * median:
        return None
    return (
        f"gradient norm {norm:.4g} is above {ratio:g} x the median {median:.4g} over "
        f"{len(history)} steps"
    )


def _median(values: list[float]) -> float:
    """The median of sorted `values`."""
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def implausible_weights(
    largest: float, limit: float, step: int, checkpoint_dir: Path
) -> DivergedError | None:
    """The error that stops a run, saving nothing, when the largest parameter magnitude every
    rank's save measured (`largest`) exceeds `limit` (checkpoint.max_abs_weight; 0: no limit), else
    None: finite weights of 1e29 verify as sound and resume into garbage."""
    if not limit or largest <= limit:
        return None
    return DivergedError(
        f"step {step}: a parameter reached magnitude {largest:.3g}, above "
        f"checkpoint.max_abs_weight={limit:g}: the run diverged, and this state was not saved. "
        f"Resume from the newest committed checkpoint with --resume {checkpoint_dir} and a lower "
        "optim.lr (or raise checkpoint.max_abs_weight if such weights are intended)"
    )
