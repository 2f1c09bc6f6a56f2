"""What the training loop calls around each step: `StepHook`, the methods a feature that watches or
steers steps overrides (each does nothing until overridden), and `HangWatch`, the hang watchdog's
part in the loop (the watchdog itself lives in `strata.parallel`, below the trainer).

The hooks are the MoE routing monitor (`routing`), the loss-spike guard (`divergence`), the profiler
(`profiling`) and `HangWatch`. For step n (1-based, as metrics.jsonl numbers it) the loop calls, in
the order of its list of hooks:

    around(n) encloses the whole step, its errors included
        start_step(n)                    before the forward and backward passes
        veto(n, loss, grad_norm)         of a finite step, before its update: a reason skips it
        end_step(n, updated)             once the update is made or skipped and the step counted
        stop(n)                          after the step's checks: an error ends the run
    record()                             merged into each logged interval's metrics record

and `running(say)` encloses the whole training loop of `Trainer.fit`; `suspect(n)` marks a
checkpoint saved after step n as possibly on its way to diverging, and `refuse_save(n)` skips
that checkpoint.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Iterator

from strata.errors import StrataError
from strata.parallel import comm, watchdog
from strata.parallel.runtime import Runtime

Say = Callable[[str], None]  # prints a line on the console (rank 0's)


class StepHook:
    """A feature's part in each training step; every method does nothing here."""

    def running(self, say: Say) -> contextlib.AbstractContextManager[None]:
        """Encloses the training loop (collective where a hook needs it): set up, then tidy up."""
        return contextlib.nullcontext()

    def around(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Encloses step `step`, from before its learning rate is set to after its last check."""
        return contextlib.nullcontext()

    def start_step(self, step: int) -> None:
        """Before step `step`'s forward and backward passes."""

    def veto(self, step: int, loss: float, grad_norm: float) -> str | None:
        """Why step `step`, whose loss and gradient norm (every rank's) are finite, must not update
        the weights, or None. Every rank decides alike."""
        return None

    def end_step(self, step: int, updated: bool) -> None:
        """After step `step`'s update (`updated`) or its skip, once the step is counted."""

    def stop(self, step: int) -> StrataError | None:
        """The error that ends the run after step `step`, or None; the loop commits a save in flight
        and raises it (every rank alike)."""
        return None

    def record(self) -> dict:
        """What this feature adds to a logged interval's metrics record."""
        return {}

    def suspect(self, step: int) -> bool:
        """Whether a checkpoint saved after step `step` may hold a run on its way to diverging."""
        return False

    def refuse_save(self, step: int) -> str | None:
        """Why the state after step `step` must not be saved (the checkpoint is skipped), or
        None."""
        return None


def all_of(contexts: Iterable[contextlib.AbstractContextManager[None]]) -> contextlib.ExitStack:
    """One context holding each of `contexts`, entered in order now and left in reverse order."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        return stack.pop_all()


class HangWatch(StepHook):
    """The hang watchdog in the loop: started (collective) around the training loop (and around
    `strata eval`'s evaluation) in a distributed run when `hang_after_s` is not 0, each step's end
    recorded as this rank's progress (whether or not a watchdog runs; each evaluation micro-batch
    is recorded by `evaluate`), stopped with the loop."""

    def __init__(self, hang_after_s: float, rt: Runtime, group) -> None:
        self.hang_after_s, self.rt, self.group = hang_after_s, rt, group

    @contextlib.contextmanager
    def running(self, say: Say) -> Iterator[None]:
        """The watchdog over the loop; a collective that fails because a peer left on a hang verdict
        ends with that verdict (`Watchdog.guard`)."""
        dog = self._start(say)
        if dog is None:
            yield
            return
        try:
            with dog.guard():
                yield
        finally:
            dog.stop()

    def end_step(self, step: int, updated: bool) -> None:
        """Record that this rank finished step `step`."""
        watchdog.step_done(step)

    def _start(self, say: Say) -> watchdog.Watchdog | None:
        """Start this rank's hang watchdog (collective), if there is a world to watch."""
        after = self.hang_after_s
        if not self.rt.distributed or not after:
            return None
        token = comm.all_gather_objects(uuid.uuid4().hex, self.group)[0]
        store = watchdog.store_from_env(timeout_s=max(10.0, after))
        if store is None:
            say("warning: no MASTER_ADDR/MASTER_PORT in the environment: hangs are not watched for")
            return None
        return watchdog.start(store, token, self.rt.rank, self.rt.world_size, after)
