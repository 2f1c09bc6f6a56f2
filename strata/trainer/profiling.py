"""Profiling a window of training steps: a torch.profiler trace per rank (Chrome/Perfetto JSON) and,
on CUDA, a memory snapshot of the same steps, plus a memory snapshot when the GPU runs out of
memory (`log.profile_steps`). The loop wraps each step in `StepProfiler.step(n)` (the profiler is one
of its step hooks: `around`); outside the window that costs nothing but a comparison.

The out-of-memory snapshot is taken by an observer the CUDA allocator calls at the failed
allocation, before the error unwinds the step and frees its tensors; where torch has no such hook it
is taken when the error leaves the step. CPU runs attach nothing.

Open a trace in https://ui.perfetto.dev or chrome://tracing, a memory snapshot (`.pickle`) in
https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from strata.config import LogConfig
from strata.trainer.hooks import Say, StepHook

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept: enough for a few steps of a large model

# The allocator's observers cannot be detached, so one per process forwards to the newest CUDA
# profiler (held weakly: a finished run's profiler may be collected).
_oom_target: weakref.ref[StepProfiler] | None = None
_oom_observer_attached = False


def _on_out_of_memory(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """The CUDA allocator's out-of-memory callback: snapshot its state while the failing step still holds its memory."""
    prof = _oom_target() if _oom_target is not None else None
    if prof is not None:
        prof.dump_oom_snapshot(from_observer=True)


def _watch_out_of_memory(prof: StepProfiler) -> bool:
    """Point the process's out-of-memory observer at `prof`, attaching it on first use; False where
    this torch has no such hook (then `StepProfiler.step` takes the snapshot as the error leaves)."""
    global _oom_target, _oom_observer_attached
    attach: Callable[[Callable[[int, int, int, int], None]], None] | None = getattr(
        torch._C, "_cuda_attach_out_of_memory_observer", None
    )
    if attach is None:
        return False
    _oom_target = weakref.ref(prof)
    if not _oom_observer_attached:
        attach(_on_out_of_memory)
        _oom_observer_attached = True
    return True


class StepProfiler(StepHook):
    """Profiles steps `first`..`last` (inclusive, numbered as metrics.jsonl numbers them: the
    first step of a run is 1) of one rank into `out_dir`: `rank{r}.json` (the trace) and on CUDA
    `rank{r}_memory.pickle`; an out-of-memory error in any step leaves `rank{r}_oom.pickle`.
    A run resumed inside the window profiles the rest of it."""

    def __init__(
        self, first: int | None, last: int | None, out_dir: Path, rank: int, device: torch.device
    ):
        self.first, self.last = first, last
        self.out_dir, self.rank = out_dir, rank
        self.cuda = device.type == "cuda"
        self.prof: profile | None = None
        self.done = first is None
        self.oom_observed = False  # the observer has written oom_path for the current error
        self.oom_observer = self.cuda and _watch_out_of_memory(self)

    @classmethod
    def from_config(
        cls, log: LogConfig, run_dir: Path, rank: int, device: torch.device
    ) -> StepProfiler:
        """The window `log.profile_steps` = [first, last] asks for (null: none), written to run_dir/profile."""
        first, last = log.profile_steps or (None, None)
        return cls(first, last, run_dir / "profile", rank, device)

    @property
    def trace_path(self) -> Path:
        return self.out_dir / f"rank{self.rank}.json"

    @property
    def memory_path(self) -> Path:
        return self.out_dir / f"rank{self.rank}_memory.pickle"

    @property
    def oom_path(self) -> Path:
        return self.out_dir / f"rank{self.rank}_oom.pickle"

    def around(self, step: int) -> contextlib.AbstractContextManager[None]:
        """`self.step(step)`: the loop's step inside, profiled when in the window."""
        return self.step(step)

    @contextlib.contextmanager
    def running(self, say: Say) -> Iterator[None]:
        """The training loop inside; what was recorded is written when it ends, however it ends."""
        try:
            yield
        finally:
            self.close()

    def in_window(self, step: int) -> bool:
        return self.first is not None and self.last is not None and self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one step (number `step`) inside: profiled when in the window. On a CUDA
        out-of-memory error, dump a memory snapshot before re-raising; on any error, write the trace
        recorded so far (the steps before a crash are what one wants to see)."""
        self.step_begin(step)
        try:
            with (
                record_function(f"step {step}")
                if self.prof is not None
                else contextlib.nullcontext()
            ):
                yield
        except torch.cuda.OutOfMemoryError:
            if not self.oom_observed:
                self.dump_oom_snapshot()
            self.oom_observed = False
            self._close_after_error()
            raise
        except BaseException:
            self._close_after_error()
            raise
        self.step_end(step)

    def step_begin(self, step: int) -> None:
        """Start recording if `step` is in the window and recording has not started."""
        if self.done or self.prof is not None or not self.in_window(step):
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()

    def step_end(self, step: int) -> None:
        """Write the trace (and memory snapshot) after the window's last step."""
        if self.prof is not None and self.last is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded, if anything; idempotent (the loop may call it after the
        window closed itself)."""
        self.done = True
        prof, self.prof = self.prof, None
        if prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        prof.export_chrome_trace(str(self.trace_path))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.memory_path))
            torch.cuda.memory._record_memory_history(enabled=None)

    def _close_after_error(self) -> None:
        """close(), but a failure writing the trace must not hide the step's own error."""
        with contextlib.suppress(Exception):
            self.close()

    def dump_oom_snapshot(self, from_observer: bool = False) -> None:
        """The allocator's state at the failure (with allocation history when inside the window). It
        never raises: the out-of-memory error is what the user must see."""
        if not self.cuda:
            return
        with contextlib.suppress(Exception):
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.oom_path))
            self.oom_observed = from_observer
