"""The launcher's hold on torchrun and its workers: torchrun started in a session of its own that
dies with the launcher, signals passed on to it (and so to every worker's session), the workers
still alive after a grace period, or at a second stop signal, killed with their sessions; and the
status each worker notes (`note_worker_status`), from which the launcher tells a job whose every
worker saved and stopped on a signal (PREEMPTED_EXIT, which torchrun does not pass on)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

# A private directory (0700) where each worker notes how it ended (`note_worker_status`): a worker
# that saved and stopped on a signal exits PREEMPTED_EXIT, which torchrun does not pass on.
STATUS_ENV = "STRATA_LAUNCH_STATUS_DIR"
# Signals `strata launch` passes on to torchrun, which passes them on to every worker's session;
# SIGHUP too, because torchrun runs in a session of its own and no longer hears the terminal close.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a second one of these kills at once
STOP_GRACE_S = 30  # after a signal, how long workers have to exit before they are killed
# torchrun kills its workers after STOP_GRACE_S; the launcher does, this much later
KILL_MARGIN_S = 5
POLL_S = 0.05


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process, zombies left out (Linux /proc)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as f:
                # the name in parentheses may hold spaces
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def worker_sessions(torchrun_pid: int) -> set[int]:
    """The sessions of torchrun's workers. torchrun starts each worker as a session leader, so a
    signal to torchrun's process group misses them; a session keeps its id after torchrun is gone,
    so it still finds a worker (and the processes the worker started) then."""
    return {
        pid for pid, (ppid, sid) in _proc_table().items() if ppid == torchrun_pid and sid == pid
    }


def session_members(sessions: set[int]) -> list[int]:
    """Live processes in any of `sessions`."""
    return [pid for pid, (_, sid) in _proc_table().items() if sid in sessions]


def _signal_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except ProcessLookupError:
        pass


def note_worker_status(status: str, env: dict[str, str] | os._Environ = os.environ) -> None:
    """In a worker started by `strata launch`: note `status` ("running" at the start, the exit code
    of a stop that saved) as this worker's in this attempt (torchrun's restart count), for the
    launcher to read; a no-op elsewhere."""
    directory = env.get(STATUS_ENV)
    if not directory:
        return
    name = f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}.{env.get('LOCAL_RANK', '0')}"
    tmp = os.path.join(directory, f".{name}.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(status)
        os.replace(tmp, os.path.join(directory, name))
    except OSError:  # the launcher is gone (it removes the directory): nobody to tell
        pass


def workers_preempted(directory: str, nproc: int) -> int | None:
    """The exit code every one of this node's `nproc` workers of the latest attempt noted after
    saving and stopping on a signal (the same code from all of them), else None: some worker failed,
    was killed, or never started."""
    attempts: dict[int, dict[str, str]] = {}
    try:
        names = [n for n in os.listdir(directory) if not n.startswith(".")]
        for name in names:
            attempt, _, local = name.partition(".")
            attempts.setdefault(int(attempt), {})[local] = Path(directory, name).read_text()
    except (OSError, ValueError):
        return None
    if not attempts:
        return None
    latest = attempts[max(attempts)]
    codes = set(latest.values())
    if len(latest) != nproc or len(codes) != 1 or not next(iter(codes)).isdigit():
        return None
    return int(codes.pop())


def _die_with_launcher(launcher: int, prctl: Callable[..., int]) -> None:
    """Run in torchrun's process before exec: if the launcher dies without passing a signal on
    (SIGKILL, the OOM killer), torchrun gets SIGTERM and stops its workers. `prctl` is looked up
    by the launcher: nothing is loaded between fork and exec."""
    prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Supervisor:
    """Waits for torchrun and owns its workers: the first signal goes to torchrun (which signals
    every worker's session, and kills them after STOP_GRACE_S); workers still alive KILL_MARGIN_S
    later, or at a second stop signal, are killed with their sessions."""

    # filled by the signal handler, handled by `wait`
    pending: list[int] = field(default_factory=list)
    first: int | None = None  # the signal that started the stop
    sessions: set[int] = field(default_factory=set)  # worker sessions seen since the stop began
    deadline: float = float("inf")  # when the launcher kills whatever is left
    killed: bool = False
    # called every POLL_S while torchrun runs and no stop began
    watch: Callable[[], None] | None = None
    # the code every worker noted after saving and stopping (PREEMPTED_EXIT), else None
    preempted: Callable[[], int | None] = lambda: None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: queue the signal for `wait`, which acts on it within POLL_S."""
        self.pending.append(signum)  # no work in the handler: `wait` acts on it within POLL_S

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Catch FORWARDED_SIGNALS for the block (in the main thread; elsewhere Python cannot)."""
        main = threading.current_thread() is threading.main_thread()
        previous = (
            {sig: signal.signal(sig, self.on_signal) for sig in FORWARDED_SIGNALS} if main else {}
        )
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        """Start torchrun (`cmd`) in a session of its own and `wait` for it. Its own session: a
        terminal's Ctrl-C reaches it once, through the launcher, never twice (a second signal would
        break torchrun's own shutdown of its workers)."""
        linux = sys.platform.startswith("linux")
        torchrun = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(_die_with_launcher, os.getpid(), ctypes.CDLL(None).prctl)
            if linux
            else None,
        )
        try:
            return self.wait(torchrun)
        finally:
            if torchrun.poll() is None:  # an error in the launcher itself: leave nothing behind
                self._kill(torchrun)
                torchrun.wait()

    def wait(self, torchrun: subprocess.Popen) -> int:
        """torchrun's exit code, or 128 + the signal that stopped the job once every worker is gone;
        but the workers' own code when every one of them saved and stopped on a signal
        (PREEMPTED_EXIT, which torchrun does not pass on: it reports a failure, or the signal)."""
        while True:
            while self.pending:
                self._handle(self.pending.pop(0), torchrun)
            code = torchrun.poll()
            if self.first is None:
                if code is not None:
                    return (self.preempted() if code else None) or code
                if self.watch is not None:
                    self.watch()
            else:
                if code is None:
                    self.sessions |= worker_sessions(torchrun.pid)
                elif not session_members(self.sessions):
                    return self.preempted() or 128 + self.first
                if time.monotonic() >= self.deadline:
                    # SIGKILL did not end them (uninterruptible sleep): give up on them
                    if self.killed:
                        print(
                            "strata launch: processes did not die after SIGKILL; leaving",
                            file=sys.stderr,
                        )
                        return 128 + self.first
                    self._kill(torchrun)
            time.sleep(POLL_S)

    def _handle(self, signum: int, torchrun: subprocess.Popen) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first, self.deadline = signum, time.monotonic() + STOP_GRACE_S + KILL_MARGIN_S
            print(
                f"strata launch: {name}: stopping torchrun and its workers (killed if still "
                "running after "
                f"{STOP_GRACE_S + KILL_MARGIN_S} s; send SIGINT or SIGTERM again to kill them now)",
                file=sys.stderr,
                flush=True,
            )
            if torchrun.poll() is None:  # not reaped yet, so its pid is still its own
                self.sessions |= worker_sessions(torchrun.pid)
                _signal_quietly(torchrun.pid, signum)
        elif signum in STOP_SIGNALS and not self.killed:
            print(
                f"strata launch: {name} again: killing torchrun and its workers",
                file=sys.stderr,
                flush=True,
            )
            self._kill(torchrun)

    def _kill(self, torchrun: subprocess.Popen) -> None:
        if torchrun.poll() is None:  # not reaped yet, so its pid is still its own
            self.sessions |= worker_sessions(torchrun.pid)
            # torchrun leads its own group
            _signal_quietly(torchrun.pid, signal.SIGKILL, group=True)
        for pid in session_members(self.sessions):
            _signal_quietly(pid, signal.SIGKILL)
        self.killed, self.deadline = True, time.monotonic() + KILL_MARGIN_S
