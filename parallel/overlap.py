"""Gradient reductions that run behind backward: each bucket's chain of collectives (a
reduce-scatter inside the node, then across nodes, then all-reduces, with local steps between)
is started when backward has produced the bucket, and waited on only before the gradients are
used. The first collective starts on the caller's thread at once; each later hop is started by a
*lane*, a thread of its own per digit group, as soon as the hop before it is done. So bucket k's
inter-node step runs while bucket k+1 reduces inside the node, and nothing waits on the training
thread.

Why threads and not only `async_op`: a chain's second collective needs the first one's result,
and waiting for it on the training thread would stall backward. Each lane issues its group's
collectives in the order the chains were started, which is the same on every rank (the same
backward), as a process group requires; the groups are dedicated to these reductions
(`Routes(dedicated=True)`), so no other collective can come between. On GPUs every NCCL group has
its own stream: the reductions run on streams of their own beside the compute stream.
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
        self._issued = threading.Event()  # the last collective has been started (or the chain failed)
        self._out: torch.Tensor | None = None
        self._work: AsyncWork | None = None
        self._next = len(hops)  # hops from here on are local, run by `wait`
        self._error: BaseException | None = None

    def wait(self) -> torch.Tensor:
        self._issued.wait()
        if self._error is not None:
            raise self._error
        if self._work is not None:
            self._work.wait()
        out = self._out
        assert out is not None  # set with the event, unless an error was
        for hop in self.hops[self._next :]:
            out, _ = hop.start(out)
        return out


class Reducer:
    """Starts chains (`start`) and owns the lanes that carry them on."""

    def __init__(self):
        self._lanes: dict[tuple[str, str], _Lane] = {}
        self._lock = threading.Lock()

    def start(self, buf: torch.Tensor, hops: list[Hop]) -> Reduction:
        """Begin reducing `buf` along `hops`; the caller must not touch `buf` until `wait()`."""
        job = Reduction(hops)
        self._advance(job, 0, buf)
        return job

    def _advance(self, job: Reduction, i: int, buf: torch.Tensor) -> None:
        """Run local hops from `i` up to the next collective, start it, and hand the chain to the
        lane of the collective after it (or mark the chain issued)."""
        hops = job.hops
        while i < len(hops) and hops[i].key is None:
            buf, _ = hops[i].start(buf)
            i += 1
        if i == len(hops):
            job._out, job._next = buf, i
            job._issued.set()
            return
        out, work = hops[i].start(buf)
        later = next((j for j in range(i + 1, len(hops)) if hops[j].key is not None), None)
        if later is None:
            job._out, job._work, job._next = out, work, i + 1
            job._issued.set()
        else:
            self._lane(hops[later].key).put((job, i + 1, out, work))

    def _lane(self, key) -> _Lane:
        with self._lock:
            if key not in self._lanes:
                self._lanes[key] = _Lane(self, f"strata-reduce-{key[0]}-{key[1]}")
            return self._lanes[key]

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.put(None)


class _Lane(threading.Thread):
    """Carries chains on, in the order they arrive: wait for the hop before, start the next."""

    def __init__(self, reducer: Reducer, name: str):
        super().__init__(name=name, daemon=True)
        self.reducer = reducer
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def put(self, item) -> None:
        self.items.put(item)

    def run(self) -> None:
        while (item := self.items.get()) is not None:
            job, i, buf, work = item
            try:
                if work is not None:
                    work.wait()
                self.reducer._advance(job, i, buf)
            except BaseException as error:  # handed to the training thread at wait()
                job._error = error
                job._issued.set()
