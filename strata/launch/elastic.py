"""torchrun for fast restarts: `python -m strata.launch.elastic ARGS` is `python -m
torch.distributed.run ARGS` (same flags, rendezvous, restarts, signals, exit codes) with two
changes. Each `python [-u] -m MODULE ...` worker it starts, the first ones and every restart, is a
fork of one process per node that has imported torch and Strata already (`strata.launch.forkserver`;
a worker the server cannot fork starts the usual way, with a warning). And a node waiting in the
c10d rendezvous for the others reads its state every `rendezvous_poll_s` instead of every second.
`strata launch --worker-start fresh` runs plain torchrun instead.

The hooks are torch's `SubprocessHandler._popen` (torch.distributed.elastic.multiprocessing), the
one place torchrun creates a worker, and the delay its dynamic rendezvous sleeps between reads of
the rendezvous state. What `_popen` returns stands in for the Popen torchrun keeps: torchrun polls,
waits for and signals the worker (`os.killpg` of its session) as before."""

from __future__ import annotations

import ctypes
import gc
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from strata.launch.forkserver import PRELOAD, ROOM_ENV, encode, environment_problem, split_command

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # prctl(2)
READY_TIMEOUT_S = 600.0  # the server's imports, on a loaded node
ARGV_SLACK, ENV_SLACK = 1024, 8192  # room beyond the first worker's, for later attempts' values
# a worker's own variables (RANK, TORCHELASTIC_*, ...: about 1 KiB) before the first is known
PER_WORKER_ROOM = 4096
TORCHRUN_FLAGS = ("-u",)  # the interpreter flags torchrun starts a `python -m` worker with
# The rendezvous store's load while nodes wait for each other: state reads a second, all nodes
# together. torch reads once a second per node, which on a restart costs up to a second per wait
# (the first node back waits for the last, which then waits for the round to close).
RENDEZVOUS_READS_PER_S = 20


def say(message: str) -> None:
    """One line to stderr in one write: torchruns and workers share the stream, and print's separate
    write of the newline lets another process's line land in between."""
    sys.stderr.write(f"strata: {message}\n")
    sys.stderr.flush()


class AdoptedWorker:
    """A forked worker, as torchrun uses a subprocess.Popen: pid, returncode, poll, wait (with
    subprocess.TimeoutExpired), send_signal, terminate, kill. It is this process's child (adopted),
    so waitpid gives its exit status, a signal's as -N."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the worker has ended (reaped here without blocking), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            # reaped elsewhere: its status is lost, as subprocess says too
            except ChildProcessError:
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the worker ends and return its exit code; subprocess.TimeoutExpired after
        `timeout` seconds, as Popen.wait raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the worker, unless it has already ended (its pid may be another process's
        by now)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """Ask the worker to stop: SIGTERM, as Popen.terminate sends."""
        self.send_signal(15)

    def kill(self) -> None:
        """Kill the worker: SIGKILL, as Popen.kill sends."""
        self.send_signal(9)


def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl


def _set_subreaper(on: int) -> int:
    """Make this process a child subreaper (or not); returns what it was."""
    prctl = _prctl()
    was = ctypes.c_int(0)
    prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    if prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    return was.value


def _fd(stream: IO | None, own: int) -> int | None:
    """The descriptor a worker gets for `own` (0, 1, 2): `stream`'s (torchrun's log file), else
    this process's own, if it has one open."""
    fd = stream.fileno() if stream is not None else own
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


@dataclass(frozen=True)
class Started:
    """What a fork server was started with: the workers' interpreter flags, the environment its
    imports saw, and the room it reserved for a worker's command line and own variables."""

    flags: list[str]
    environment: dict[str, str]
    argv_room: int
    env_room: int


class ForkServer:
    """This node's fork server, as torchrun's side sees it: started before torchrun's imports
    (`start_early`) or at the first worker, asked for each worker after."""

    def __init__(self, preload: Sequence[str] = PRELOAD, ready_timeout_s: float = READY_TIMEOUT_S):
        self.preload = list(preload)
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.broken: str | None = None  # why no worker is forked any more
        self.warned: set[str] = set()
        self.started: Started | None = None  # what the running server was started with
        self.ready = False  # its ready message read

    def start_early(self, argv: Sequence[str]) -> None:
        """Start the server now, from this process's environment, for the workers of torchrun
        `argv` (this process's arguments): its imports then run while torchrun's own do, instead of
        after them. The first worker still decides: if its interpreter flags or environment are not
        what the server started with (torchrun set a variable, OMP_NUM_THREADS where the caller
        left it unset for several workers), or its command line would not fit, that server is
        replaced by one started as `spawn` would have. Nothing is started for a script worker
        (no -m), which the server would not fork."""
        if not {"-m", "--module"} & set(argv):
            return
        # the worker's command is inside argv
        worker_bound = encode([sys.executable, *TORCHRUN_FLAGS, "-m", *argv])
        self._launch(
            list(TORCHRUN_FLAGS), len(worker_bound) + ARGV_SLACK, PER_WORKER_ROOM + ENV_SLACK
        )

    def _launch(self, flags: list[str], argv_room: int, env_room: int) -> None:
        """Start the server process, leaving its ready message on the socket for `_await_ready`."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [
            sys.executable,
            *flags,
            "-m",
            "strata.launch.forkserver",
            "--fd",
            str(theirs.fileno()),
        ]
        cmd += ["--preload", ",".join(self.preload), "--room", ""]
        # Room in the server's argument and environment strings for each worker's own (see
        # forkserver.show_in_proc).
        cmd[-1] = "x" * max(1, argv_room - len(encode(cmd)))
        self.started = Started(flags, dict(os.environ), argv_room, env_room)
        try:
            self.proc = subprocess.Popen(
                cmd, env={**os.environ, ROOM_ENV: "x" * env_room}, pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        self.sock = mine

    def _fits(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether the running server can fork this worker: its flags, environment and room."""
        started, command = self.started, split_command(argv)
        if started is None or command is None:
            return False
        return (
            command[0] == started.flags
            and environment_problem(started.environment, env) is None
            and len(encode(argv)) <= started.argv_room
            and _own_variables_bytes(started.environment, env) <= started.env_room
        )

    def _start(self, argv: list[str], env: dict[str, str]) -> None:
        """Start the server for its first worker (`argv`, `env`): that worker's flags and sizes and a
        margin (its environment then is torchrun's, OMP_NUM_THREADS included)."""
        flags, _, _ = split_command(argv) or ([], "", [])
        argv_room = len(encode(argv)) + ARGV_SLACK
        self._launch(flags, argv_room, _own_variables_bytes(dict(os.environ), env) + ENV_SLACK)

    def _await_ready(self) -> None:
        assert self.sock is not None and self.proc is not None
        self.sock.settimeout(self.ready_timeout_s)
        try:
            reply = json.loads(
                self.sock.recv(1 << 16) or b'{"error": "it exited before it was ready"}'
            )
        except (OSError, ValueError) as e:
            reply = {"error": f"no word from it within {self.ready_timeout_s:.0f} s ({e})"}
        self.sock.settimeout(None)
        self.ready = True
        if "error" in reply:
            self._break(f"the fork server did not start: {reply['error']}")
            return
        say(
            f"fork server ready (pid {self.proc.pid}; torch and Strata imported in "
            f"{reply['import_s']:.1f} s): workers start as its forks"
        )

    def _break(self, why: str) -> None:
        self.broken = why
        self.close()

    def _warn(self, why: str) -> None:
        if why not in self.warned:
            self.warned.add(why)
            say(f"warning: starting a worker as a fresh Python: {why}")

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], stdio: Sequence[int | None]
    ) -> AdoptedWorker | None:
        """Fork a worker running `argv` with environment `env` and `stdio` as its 0, 1, 2 (None: as
        this process's), or None (with a warning once per reason) when the server cannot."""
        argv = [str(a) for a in argv]
        if split_command(argv) is None:
            return None  # not a `python -m` worker of this interpreter: torchrun starts it
        if self.proc is not None and not self.ready and not self._fits(argv, env):
            self.close()  # started early for workers unlike this one
        if self.proc is None and self.broken is None:
            self._start(argv, env)
        if self.proc is not None and not self.ready:
            self._await_ready()
        if self.broken is not None or self.sock is None:
            self._warn(self.broken or "the fork server is not running")
            return None
        targets = [t for t, fd in zip((0, 1, 2), stdio) if fd is not None]
        fds = [fd for fd in stdio if fd is not None]
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdio": targets}
        t0 = time.perf_counter()
        was = _set_subreaper(1)  # the worker's parent exits at once: this process adopts it
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            message = self.sock.recv(1 << 16)
        except OSError as e:
            message = json.dumps({"error": f"the fork server is gone ({e})"}).encode()
        finally:
            _set_subreaper(was)
        reply = json.loads(message or b'{"error": "the fork server exited"}')
        if "pid" not in reply:
            if self.proc is not None and self.proc.poll() is not None:
                self._break(reply["error"])
            self._warn(reply["error"])
            return None
        say(
            f"worker pid {reply['pid']} (local rank {env.get('LOCAL_RANK', '?')}, restart "
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}) forked in "
            f"{1000 * (time.perf_counter() - t0):.0f} ms"
        )
        return AdoptedWorker(reply["pid"], argv)

    def close(self) -> None:
        """Stop the server (it exits when its socket closes)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            if not self.ready:
                self.proc.kill()  # still importing, no worker of its own: nothing to wait for
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc, self.started, self.ready = None, None, False


def _own_variables_bytes(base: dict[str, str], env: dict[str, str]) -> int:
    """Bytes of the variables of a worker's environment `env` that are not as in `base`."""
    return len(encode([f"{k}={v}" for k, v in env.items() if base.get(k) != v]))


def install(server: ForkServer) -> bool:
    """Route torchrun's worker starts through `server`; False where this torch has no such hook."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return False
    handler = subprocess_handler.SubprocessHandler
    fresh = getattr(handler, "_popen", None)
    if fresh is None:
        return False

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        stdio = (_fd(None, 0), _fd(self._stdout, 1), _fd(self._stderr, 2))
        return server.spawn(args, env, stdio) or fresh(self, args, env)

    handler._popen = _popen  # type: ignore[method-assign]
    return True


def rendezvous_poll_s(max_nodes: int) -> float:
    """Seconds between a waiting node's reads of the rendezvous state: torch's 1 s for large jobs,
    less where few nodes wait (RENDEZVOUS_READS_PER_S from all of them together), 0.05 s at least."""
    return min(1.0, max(0.05, max_nodes / RENDEZVOUS_READS_PER_S))


def install_rendezvous_poll(poll_s: float) -> bool:
    """Make torch's dynamic (c10d) rendezvous read its state every `poll_s` while a node waits for
    the others: the delay between its reads (1 s) and how long a read stays fresh (its state cache,
    1 s: polling faster alone would reread the cache). False where this torch has neither."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    delay = getattr(dynamic_rendezvous, "_delay", None)
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    if (
        delay is None
        or holder is None
        or "cache_duration" not in inspect.signature(holder.__init__).parameters
    ):
        return False

    def _delay(seconds: float | tuple[float, float]) -> None:
        # its other delays (a random back-off) as they are
        delay(poll_s if seconds == 1 else seconds)

    init = holder.__init__

    def __init__(self: Any, backend: Any, settings: Any, cache_duration: float = poll_s) -> None:
        init(self, backend, settings, min(cache_duration, poll_s))

    dynamic_rendezvous._delay = _delay
    holder.__init__ = __init__
    return True


def main(argv: list[str] | None = None) -> None:
    """torchrun whose workers are forked: start the fork server while torch imports, route torchrun's
    worker starts through it (or warn and start them fresh), poll the rendezvous faster, then
    run torchrun with `argv`."""
    server = ForkServer()
    linux = sys.platform.startswith("linux")
    if linux:  # before torch is imported here: the server's imports and these run side by side
        server.start_early(sys.argv[1:] if argv is None else argv)
    try:
        from torch.distributed.run import main as torchrun
        from torch.distributed.run import parse_args, parse_min_max_nnodes

        if not linux or not install(server):
            server.close()
            say("warning: this torch or system cannot fork workers; they start fresh")
        _, max_nodes = parse_min_max_nnodes(parse_args(argv).nnodes)
        install_rendezvous_poll(rendezvous_poll_s(max_nodes))
        # What the imports made lives until exit: out of the collector's sight, Python's exit does
        # not walk it (half a second of every job's end on 2 cores).
        gc.freeze()
        sys.exit(_run_reporting_failures(torchrun, argv))
    finally:
        server.close()


def _run_reporting_failures(torchrun, argv: list[str] | None) -> int:
    """torchrun with its ending failures as one message each instead of Python tracebacks (the
    workers' own output says what went wrong); the exit code stays torchrun's (1)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        torchrun(argv)
    except ChildFailedError as e:
        failed = ", ".join(
            f"local rank {f.local_rank} (pid {f.pid}) exited with {f.exitcode}"
            for f in e.failures.values()
        )
        say(f"worker failure: {failed}; its output above says why")
        return 1
    except SignalException as e:  # the launcher asked torchrun to stop; it reports the outcome
        say(f"stopped by {e.sigval.name}")
        return 1
    except RendezvousError as e:
        say(
            f"the rendezvous failed: {e} (timed out waiting for the other nodes, or their store "
            "is out of reach): "
            "check --rdzv-endpoint and that every node started with the same --nnodes"
        )
        return 1
    return 0


if __name__ == "__main__":
    main()
