"""Gradient reductions that run behind backward: each bucket's chain of collectives (a
reduce-scatter inside the node, then across nodes, all-gathers back, with local steps between) is
started when backward has produced the bucket and waited on only before the gradients are used.
Every hop of a chain is issued by a *lane*, a thread of its own per (levels, operation) with a
process group of its own, as soon as the hop before it is done: bucket k's inter-node step runs
while bucket k+1 reduces inside the node, and nothing waits on the training thread.

Why lanes and not only `async_op`: a chain's second collective needs the first one's result, and
waiting for it on the training thread would stall backward. A process group needs every member
to issue its collectives in the same order; here each group is used by one lane only
(`Routes(dedicated=True)`: no other collective can come between), and a lane issues its hops in
the order the training thread started the chains (`Reducer.start` queues every hop of a chain on
its lane at once), which is the same on every rank because the backward is. On GPUs every NCCL
group has its own stream: the reductions run on streams of their own beside the compute stream.
"""

from __future__ import annotations

import queue
import threading

import torch

from strata.parallel.comm import AsyncWork
from strata.parallel.routes import Hop


class Reduction:
    """One bucket's chain in flight. `wait()` returns the chain's output (and raises what a hop raised)."""

    def __init__(self, hops: list[Hop]):
        self.hops = hops
        # collective hop index -> (its input, the work that must finish first), set by the hop
        # before
        self._handed: dict[int, tuple[torch.Tensor, AsyncWork | None]] = {}
        self._ready = threading.Condition()
        self._collectives = [i for i, hop in enumerate(hops) if hop.key is not None]
        # output, its work, local hops from
        self._done: tuple[torch.Tensor, AsyncWork | None, int] | None = None
        self._error: BaseException | None = None

    def _hand(self, i: int, buf: torch.Tensor, work: AsyncWork | None) -> None:
        with self._ready:
            self._handed[i] = (buf, work)
            self._ready.notify_all()

    def _finish(self, buf: torch.Tensor, work: AsyncWork | None, local_from: int) -> None:
        with self._ready:
            self._done = (buf, work, local_from)
            self._ready.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._ready:
            self._error = error
            self._ready.notify_all()

    def _take(self, i: int) -> tuple[torch.Tensor, AsyncWork | None] | None:
        """Block until hop `i`'s input is handed over (None: the chain failed before it)."""
        with self._ready:
            self._ready.wait_for(lambda: i in self._handed or self._error is not None)
            return self._handed.pop(i, None)

    def wait(self) -> torch.Tensor:
        with self._ready:
            self._ready.wait_for(lambda: self._done is not None or self._error is not None)
        if self._error is not None:
            raise self._error
        assert self._done is not None  # by the wait above
        out, work, local_from = self._done
        if work is not None:
            work.wait()
        for hop in self.hops[local_from:]:
            out, _ = hop.start(out)
        return out


class Reducer:
    """Starts chains (`start`) and owns the lanes that carry them."""

    def __init__(self):
        self._lanes: dict[tuple[str, str, str], _Lane] = {}

    def start(self, buf: torch.Tensor, hops: list[Hop]) -> Reduction:
        """Begin reducing `buf` along `hops`; the caller must not touch `buf` until `wait()`. Called
        on the training thread only: the order of calls is each lane's order."""
        job = Reduction(hops)
        if not job._collectives:
            job._finish(buf, None, 0)
            return job
        job._hand(job._collectives[0], buf, None)
        for i in job._collectives:
            key = hops[i].key
            assert key is not None  # a collective hop
            if key not in self._lanes:
                self._lanes[key] = _Lane(f"strata-reduce-{'-'.join(key)}")
            self._lanes[key].put((job, i))
        return job

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.put(None)


class _Lane(threading.Thread):
    """Issues one group's hops, in the order they were queued: wait for the hop before, run the
    local hops between, start this one, hand its output on."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def put(self, item) -> None:
        self.items.put(item)

    def run(self) -> None:
        while (item := self.items.get()) is not None:
            job, i = item
            handed = job._take(i)
            if handed is None:
                continue  # the chain failed earlier: wait() raises that
            try:
                buf, work = handed
                if buf.is_cuda and torch.cuda.current_device() != buf.device.index:
                    torch.cuda.set_device(buf.device)  # a new thread starts on device 0
                if work is not None:
                    work.wait()
                before = max((c for c in job._collectives if c < i), default=-1)
                for hop in job.hops[before + 1 : i]:  # local hops between the two collectives
                    buf, _ = hop.start(buf)
                out, work = job.hops[i].start(buf)
                later = [c for c in job._collectives if c > i]
                if later:
                    job._hand(later[0], out, work)
                else:
                    job._finish(out, work, i + 1)
            except BaseException as error:  # handed to the training thread at wait()
                job._fail(error)
