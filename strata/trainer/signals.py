"""Stopping on a signal: which signals ask every rank to finish its step, save and exit, how a
repeated delivery of the same request is told from a second one, and the exit code of a run that
saved and stopped (`PREEMPTED_EXIT`)."""

from __future__ import annotations

import os
import signal
import threading
import time

# A run stopped by a signal after saving exits with this code (EX_TEMPFAIL, "try again later"): the
# Slurm script requeues the job on it, and a requeued job resumes from the newest checkpoint.
PREEMPTED_EXIT = 75
# Signals that make every rank finish its step, save a checkpoint and exit: SIGTERM (a scheduler's
# stop), SIGUSR1 (Slurm's warning before the time limit, `--signal=B:USR1@SECONDS`), SIGINT
# (Ctrl-C).
GRACEFUL_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


# A repeat of the first signal this soon after it is the same request arriving twice, not a second
# one: under Slurm a signal reaches a worker both from slurmstepd (which signals every process of
# the step) and through torchrun, which passes it on.
REPEAT_WINDOW_S = 0.5


class StopRequest:
    """Catches the first of GRACEFUL_SIGNALS: the handler only records it (the step in progress
    finishes, and the ranks agree at its end to save and stop). A second signal later than
    REPEAT_WINDOW_S aborts: the handler puts the default action back and sends the signal again."""

    def __init__(self) -> None:
        self.signum = 0  # the first signal caught, 0 for none
        self.at = 0.0  # when (time.monotonic)
        self.previous: dict[int, object] = {}

    def on_signal(self, signum: int, frame: object) -> None:
        if not self.signum:
            self.signum, self.at = signum, time.monotonic()
            return
        if signum == self.signum and time.monotonic() - self.at < REPEAT_WINDOW_S:
            return
        for sig in GRACEFUL_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # ends the process as the signal's default action does

    def install(self) -> None:
        """Take over GRACEFUL_SIGNALS; only the main thread may (a run in another thread keeps the defaults)."""
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.on_signal) for sig in GRACEFUL_SIGNALS}

    def restore(self) -> None:
        """Put the previous handlers back; after a stop, the stop's own signal stays ignored: the
        process is on its way out with PREEMPTED_EXIT, and the same request arriving a second time
        (Slurm's and torchrun's copies) must not kill it before it gets there."""
        for sig, handler in self.previous.items():
            stopping = sig == self.signum
            signal.signal(sig, signal.SIG_IGN if stopping else handler)  # type: ignore[arg-type]
        self.previous = {}


class Preempted(SystemExit):
    """Every rank saved and stopped on a signal; the process exits with PREEMPTED_EXIT."""

    def __init__(self, signum: int) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.signum = signum
