"""Hang detection: each rank records its progress (the collective it is in, the step) and a
watchdog thread publishes it with a heartbeat in the job's c10d store and reads every other
rank's. When no rank has made progress for `parallel.hang_timeout_s`, the first rank to notice
names the stuck rank, its host and its last collective in one verdict that every rank prints
before it exits with HANG_EXIT, long before the collective timeout would end the job with a
bare "timed out" on each rank. A restart (`strata launch --max-restarts`) then resumes from
the newest snapshot or checkpoint.

Own code, not torch's: gloo has no watchdog, and NCCL's (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC and
the flight recorder) watches one rank's own collectives, so it cannot say which peer never
arrived. Progress is a count, compared across ranks, not a clock: hosts' clocks need not agree."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

HANG_EXIT = 124  # as coreutils' `timeout`: the job did not finish because something stopped moving


@dataclass
class Progress:
    """This rank's progress, written by the training thread and read by the watchdog thread
    (whole-attribute writes: no lock needed)."""

    seq: int = 0  # collectives (and long phases) entered so far
    doing: str = "start-up"  # the collective or phase it is in, or the last it left
    inside: bool = False  # in `doing` now (waiting on peers), rather than busy on its own
    step: int = 0
    evaluated: int = 0  # evaluation micro-batches finished: progress between (or without) steps
    paused: str = ""  # a long phase (a checkpoint save) in which no collective progress is expected


progress = Progress()


class _Inside:
    """Marks `progress` as inside a collective for a `with` block: cheap enough for every collective.
    Only the training (main) thread's collectives are marked: a background thread's (gradient
    reductions in flight) would interleave with them, and the main thread marks its wait for
    their results anyway."""

    __slots__ = ("name", "before", "marks")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        self.marks = threading.current_thread() is threading.main_thread()
        if not self.marks:
            return
        self.before = (progress.doing, progress.inside)
        progress.seq += 1
        progress.doing, progress.inside = self.name, True

    def __exit__(self, *exc: object) -> None:
        if not self.marks:
            return
        progress.seq += 1
        # a collective inside another (all_true inside a save): back to the outer one
        if self.before[1]:
            progress.doing, progress.inside = self.before
        else:
            progress.inside = False


def collective(op: str, dim: str | None = None) -> _Inside:
    """`with collective("all_reduce", "dp"):` around a blocking collective or send/recv."""
    return _Inside(f"{op} over {dim}" if dim else op)


@contextlib.contextmanager
def paused(phase: str) -> Iterator[None]:
    """`with paused("checkpoint save"):` around a phase that may outlast the hang timeout on its
    own (writing a checkpoint): the watchdog does not count it as a hang, unless a rank stops
    answering altogether."""
    before = progress.paused
    progress.paused, progress.seq = phase, progress.seq + 1
    try:
        yield
    finally:
        progress.paused, progress.seq = before, progress.seq + 1


def step_done(step: int) -> None:
    """Record that this rank finished optimizer step `step` (progress the watchdog sees)."""
    progress.step, progress.seq = step, progress.seq + 1


def batch_done() -> None:
    """Record that this rank finished an evaluation micro-batch: progress, and, like a step, what
    arms the watchdog (`strata eval` takes no step; an evaluation before the first step neither)."""
    progress.evaluated, progress.seq = progress.evaluated + 1, progress.seq + 1


@dataclass
class _Seen:
    """What a watcher knows of one rank: its last record and when (here, monotonic) it changed."""

    record: dict
    beat_at: float
    progress_at: float


class Watchdog:
    """The thread: every `interval_s`, publish this rank's record, stop if a verdict is out, and
    look for a hang. Records live under `prefix` in `store` (a client of the job's TCPStore)."""

    def __init__(self, store, prefix: str, rank: int, world_size: int, hang_after_s: float):
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world_size
        self.hang_after_s = hang_after_s
        self.interval_s = min(5.0, max(0.1, hang_after_s / 10))
        self.host, self.pid, self.beat = socket.gethostname(), os.getpid(), 0
        self.start_step, self.start_evaluated = progress.step, progress.evaluated
        self.seen: dict[int, _Seen] = {}
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="strata-watchdog", daemon=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def publish(self, done: bool = False) -> None:
        self.beat += 1
        record = {
            **asdict(progress),
            "beat": self.beat,
            "host": self.host,
            "pid": self.pid,
            "done": done,
        }
        self.store.set(self._key(f"rank{self.rank}"), json.dumps(record))

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop watching, and tell the others this rank is done: ranks finish the run at
        different times, and one that no longer beats must not look stopped."""
        self._stop.set()
        self.thread.join()
        try:
            self.publish(done=True)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                verdict = self.check()
            except Exception as e:  # noqa: BLE001 - the store's host is gone or unreachable: say so, stop
                message = (
                    f"the job's store stopped answering the watchdog of rank {self.rank} "
                    f"({type(e).__name__}: {e}): the node that hosts it (torchrun's on the first "
                    f"node, or `strata store`) is down, or {socket.gethostname()} lost its link to "
                    "it"
                )
                verdict = json.dumps({"message": message, "stuck": [], "answering": 0})
            if verdict and not self._stop.is_set():
                self._exit(verdict)

    def check(self) -> str | None:
        """One round: publish, then the verdict already out, or a new one, or None. A verdict is
        JSON: {"message": the error every rank prints, "stuck": the ranks it names}."""
        self.publish()
        key = self._key("verdict")
        if self.store.check([key]):
            return self.store.get(key).decode()
        now = time.monotonic()
        keys = [self._key(f"rank{r}") for r in range(self.world)]
        present = self.store.check(keys)  # a rank that has not published yet is not watched yet
        if present:
            for r, raw in zip(range(self.world), self.store.multi_get(keys)):
                self._note(r, json.loads(raw), now)
        found = self._find_hang(now)
        if found is None:
            return None
        return self.store.compare_set(key, "", found).decode() or found  # the first verdict wins

    def _note(self, rank: int, record: dict, now: float) -> None:
        seen = self.seen.get(rank)
        if seen is None:
            self.seen[rank] = _Seen(record, now, now)
            return
        marks = ("seq", "step", "paused")
        if record["beat"] != seen.record["beat"]:
            seen.beat_at = now
        if any(record[m] != seen.record[m] for m in marks) or record["paused"] or record["done"]:
            seen.progress_at = now
        seen.record = record

    def _find_hang(self, now: float) -> str | None:
        if len(self.seen) < self.world or not self._armed():
            return None
        limit = self.hang_after_s
        silent = [
            r for r, s in self.seen.items() if now - s.beat_at > limit and not s.record["done"]
        ]
        if silent:
            return self._verdict(
                silent, "is not responding (stopped, frozen or gone)", now, answering=False
            )
        if now - max(s.progress_at for s in self.seen.values()) <= limit:
            return None
        records = {r: s.record for r, s in self.seen.items()}
        outside = [r for r, rec in records.items() if not rec["inside"]]
        if outside:
            return self._verdict(
                outside, "is busy outside any collective (compute, data, or a deadlock there)", now
            )
        steps = {rec["step"] for rec in records.values()}
        if len(steps) > 1:
            behind = [r for r, rec in records.items() if rec["step"] == min(steps)]
            return self._verdict(
                behind, f"is still in step {min(steps) + 1} while others are ahead", now
            )
        usual, _ = Counter(rec["doing"] for rec in records.values()).most_common(1)[0]
        odd = [r for r, rec in records.items() if rec["doing"] != usual]
        if odd:
            return self._verdict(
                odd, f"waits in a different collective than the others ({usual})", now
            )
        return self._verdict(
            sorted(records),
            "waits, as every rank does, in the same collective: no rank is missing from it, so the "
            "collective itself (the network or the backend) hangs",
            now,
        )

    def _armed(self) -> bool:
        """Whether this rank is past its start-up (compilation, loading, the first collectives'
        set-up, which may take long without a hang): it has finished a step or an evaluation
        micro-batch since the watchdog started."""
        return progress.step > self.start_step or progress.evaluated > self.start_evaluated

    def _verdict(self, stuck: list[int], why: str, now: float, answering: bool = True) -> str:
        since = now - max(self.seen[r].progress_at for r in stuck)

        def who(r: int) -> str:
            rec = self.seen[r].record
            where = "in" if rec["inside"] else "after"
            return f"rank {r} (host {rec['host']}, pid {rec['pid']}; last collective: {where} {rec['doing']})"

        waiting = sorted(
            {
                rec.record["doing"]
                for r, rec in self.seen.items()
                if r not in stuck and rec.record["inside"]
            }
        )
        message = (
            f"hang: {'; '.join(who(r) for r in stuck[:8])}{' and more' if len(stuck) > 8 else ''} "
            f"{why}; no progress for {since:.0f} s"
            + (f"; the other ranks wait in {', '.join(waiting)}" if waiting else "")
            + f". Every rank stops (exit {HANG_EXIT}); a restart (--max-restarts) resumes from "
            "the newest snapshot or "
            f"checkpoint. Noticed by rank {self.rank} after "
            f"parallel.hang_timeout_s={self.hang_after_s:g}"
        )
        return json.dumps(
            {
                "message": message,
                "stuck": stuck,
                "answering": self.world - (0 if answering else len(stuck)),
            }
        )

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around the training loop: when a collective fails because a peer left on a hang verdict
        (its exit breaks the connections), end with that verdict, not the backend's error."""
        try:
            yield
        except RuntimeError:  # what torch raises for a broken connection (DistBackendError is one)
            # A rank leaves on a verdict only after the verdict is in the store (`check` puts it
            # there before `_exit`), so a failure its exit caused finds it there at once. No
            # verdict: a peer crashed; raise now, as waiting for one would only delay the restart.
            key = self._key("verdict")
            try:
                if not self._stop.is_set() and self.store.check([key]):
                    self._exit(self.store.get(key).decode())
            except OSError:
                pass
            raise

    def _exit(self, verdict: str) -> None:
        """Print the verdict, end a stopped rank on this host (it cannot end itself), exit. Once per
        process: the watchdog thread and `guard` may both get here."""
        if not self._exiting.acquire(blocking=False):
            while True:  # the other is printing and exiting
                time.sleep(1)
        found = json.loads(verdict)
        for rank in found["stuck"]:
            if rank in self.seen and rank != self.rank:
                rec = self.seen[rank].record
                if rec["host"] == self.host:
                    _kill_if_stopped(rec["pid"])
        print(f"strata: rank {self.rank}: {found['message']}", file=sys.stderr, flush=True)
        _record_for_torchrun(found["message"])
        self._wait_for_the_others(found["answering"])
        # the training thread is blocked in a collective: nothing cleaner can end it
        os._exit(HANG_EXIT)

    def _wait_for_the_others(self, answering: int) -> None:
        """Exit together: the first rank to leave breaks the others' collectives, whose training
        threads would then fail with the backend's error before their watchdogs read the verdict.
        So each rank counts itself out and waits (briefly) until every rank that can has read it."""
        key, deadline = self._key("exiting"), time.monotonic() + 2 + 3 * self.interval_s
        try:
            count = self.store.add(key, 1)
            while count < answering and time.monotonic() < deadline:
                time.sleep(0.02)
                count = self.store.add(key, 0)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            pass


def _kill_if_stopped(pid: int) -> None:
    """SIGKILL `pid` if it is stopped (SIGSTOP, a debugger): a stopped process never acts on
    torchrun's SIGTERM, so its restart would wait the whole shutdown grace period for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass


def _record_for_torchrun(verdict: str) -> None:
    """Write the verdict to torchrun's per-worker error file, so its failure summary shows it."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(RuntimeError(verdict))
    except Exception:  # noqa: BLE001 - best effort: the verdict is already on stderr
        pass


def store_from_env(timeout_s: float):
    """A client of the store torchrun (or srun's MASTER_ADDR/MASTER_PORT) gives the job, or None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def start(store, token: str, rank: int, world_size: int, hang_after_s: float) -> Watchdog:
    """Publish this rank's first record and start its watchdog. `token` (the same on every rank,
    new for every start) keeps the records of a restarted job apart from its earlier attempt's."""
    dog = Watchdog(store, f"strata/watchdog/{token}", rank, world_size, hang_after_s)
    dog.publish()
    dog.start()
    return dog
