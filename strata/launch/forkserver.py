"""The fork server: one process per node that imports torch and Strata once, then forks each worker
torchrun asks for (`strata.launch.elastic` asks), so a restarted worker starts in milliseconds
instead of re-importing for seconds.

A forked worker is what torchrun would have started: the server forks twice and torchrun, a child
subreaper while it asks, adopts the grandchild, so the worker is torchrun's child (torchrun waits
for it and gets its exit status, a signal's included); it leads a session of its own, takes
torchrun's stdin, stdout and stderr (or its log files), its environment and working directory, and
runs `python -m MODULE ARGS` as `__main__`. /proc shows it as that command with that environment
(`ps`, and tools that find a worker by `RANK=...` in /proc/PID/environ, see the worker's own): the
server starts with room reserved in its argument and environment areas, and the worker writes its
own command line and environment there.

Fork safety: the server runs no thread of its own and no computation, and never initialises
CUDA. Before each fork it checks that it still has one Python thread, that CUDA is not
initialised, that the worker's environment differs from its own only in torchrun's per-worker
variables (an import may have read any other), and that the worker's command line and environment
fit the reserved room; otherwise it refuses and torchrun starts that worker the usual way.
Native thread pools: numpy's OpenBLAS stops its pool before a fork (its own atfork handler; seen
here: the parent is down to one thread after the fork, the child's matrix product starts a new
pool); torch's OpenMP pool starts only at the first parallel operation, which the server never runs.

Not multiprocessing's forkserver: its children are the server's (torchrun could neither wait for
them nor see how they ended), share the server's session and stdio, and run a pickled function,
not a module with a command line."""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What `strata train` loads in every run, by its first step: what the CLI and its train command
# import (not strata.launch.cli itself: it runs as __main__, and runpy warns about a module it runs
# that was imported before), the trainer, in-memory snapshots, torch._dynamo (torch's optimizers
# import it at their first call) and pipelining (a tenth of a second once _dynamo is loaded).
PRELOAD = (
    "strata.launch.commands",
    "strata.launch.supervisor",
    "strata.parallel.runtime",
    "strata.trainer.jobs",
    "strata.checkpoint.snapshot",
    "torch._dynamo",
    "torch.distributed.pipelining",
    "strata.parallel.pipeline",
)
# Variables torchrun sets for each worker (torch.distributed.elastic's agent and start_processes):
# they may differ between the server and a worker; no import reads them.
PER_WORKER = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises, which the server never does
    }
)
PER_WORKER_PREFIXES = ("TORCHELASTIC_",)
ROOM_ENV = "STRATA_FORKSERVER_ROOM"  # the server's placeholder for the workers' environments
MAX_MESSAGE = 1 << 20


@dataclass(frozen=True)
class Job:
    """What a forked worker runs: `python -m module *args` as __main__."""

    module: str
    args: list[str]

    def run(self) -> None:
        """Run the module as __main__ in this forked process, with sys.argv as `python -m` would set
        it."""
        sys.argv = [self.module, *self.args]  # runpy puts the module's path in argv[0], as -m does
        runpy.run_module(self.module, run_name="__main__", alter_sys=True)


# --- the request ------------------------------------------------------------------------------


def split_command(
    argv: list[str], executable: str = sys.executable
) -> tuple[list[str], str, list[str]] | None:
    """(interpreter flags, module, arguments) of `executable [flags] -m module args`, or None for
    any other command (another interpreter, a script, flags other than -u)."""
    if not argv or argv[0] != executable or "-m" not in argv[1:]:
        return None
    at = argv.index("-m", 1)
    flags = argv[1:at]
    if any(f != "-u" for f in flags) or at + 1 >= len(argv):
        return None
    return flags, argv[at + 1], argv[at + 2 :]


def environment_problem(server: dict[str, str], worker: dict[str, str]) -> str | None:
    """Why a worker with environment `worker` must not be forked from a server started with
    `server`: a variable other than torchrun's per-worker ones that differs."""
    keys = {k for k in server.keys() | worker.keys() if server.get(k) != worker.get(k)}
    bad = sorted(k for k in keys if k not in PER_WORKER and not k.startswith(PER_WORKER_PREFIXES))
    if not bad:
        return None
    return f"its environment differs from the fork server's in {', '.join(bad)}"


def encode(strings: list[str]) -> bytes:
    """NUL-terminated strings, as the kernel lays out a process's arguments and environment."""
    return b"".join(os.fsencode(s) + b"\0" for s in strings)


def env_strings(env: dict[str, str]) -> list[str]:
    """An environment as KEY=VALUE strings, in the order the process's environment area holds them."""
    return [f"{k}={v}" for k, v in env.items()]


# --- /proc's view of this process ---------------------------------------------------------------


def proc_areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, end) of this process's argument and environment strings, where the kernel put them
    at exec and reads them for /proc/PID/cmdline and /proc/PID/environ (proc(5): stat fields 48-51)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])
    return (arg_start, arg_end), (env_start, env_end)


def proc_areas_problem() -> str | None:
    """Why this process cannot show another command line and environment in /proc, or None: the
    kernel must say where its exec-time strings are (some sandboxes' /proc does not), in writable
    memory of this process that holds what /proc shows now."""
    try:
        (a0, a1), (e0, e1) = proc_areas()
    except (OSError, ValueError):
        return "/proc/self/stat does not say where this process's arguments and environment are"
    if not (0 < a0 < a1 and 0 < e0 < e1):
        return f"/proc/self/stat gives no argument and environment areas ({a0:#x}-{a1:#x}, {e0:#x}-{e1:#x})"
    for start, end, name in ((a0, a1, "cmdline"), (e0, e1, "environ")):
        mapped = False
        for line in Path("/proc/self/maps").read_text().splitlines():
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            mapped = mapped or (lo <= start and end <= hi and perms.startswith("rw"))
        if (
            not mapped
            or ctypes.string_at(start, end - start) != Path(f"/proc/self/{name}").read_bytes()
        ):
            return f"/proc/self/{name} does not show this process's own {name} memory"
    return None


def room() -> tuple[int, int]:
    """Bytes of command line and environment this process can show in /proc."""
    (a0, a1), (e0, e1) = proc_areas()
    return a1 - a0, e1 - e0


def replace_environ(env: dict[str, str]) -> None:
    """Make `env` this process's whole environment, os.environ and the C library's alike, none of
    it left pointing into the exec-time strings (which `show_in_proc` then overwrites)."""
    os.environ.clear()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "clearenv"):
        libc.clearenv()
    os.environ.update(env)


def show_in_proc(argv: list[str], env: dict[str, str]) -> None:
    """Write `argv` and `env` over this process's exec-time argument and environment strings, so
    /proc/PID/cmdline and /proc/PID/environ (and ps) show them; the rest of each area is NULs (the
    last byte of the arguments stays NUL: the kernel then shows the whole area as arguments).
    Call `replace_environ` first. The environment keeps the exec-time order, so variables the
    server and the worker share keep their bytes at the same addresses (a library that kept a
    pointer from getenv() still reads the same value)."""
    (a0, a1), (e0, e1) = proc_areas()
    for (start, end), data in (((a0, a1), encode(argv)), ((e0, e1), encode(env_strings(env)))):
        if len(data) > end - start:
            raise ValueError(f"{len(data)} bytes do not fit the {end - start} reserved")
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


# --- the server -------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


@dataclass
class Server:
    """The server's state: its socket to torchrun's side, its own environment (what the imports
    saw), and what a worker must get back (signal handlers, the garbage collector)."""

    sock: socket.socket
    environment: dict[str, str]
    # the ones the server changed, as they were
    handlers: dict[int, Any] = field(default_factory=dict)
    collecting: bool = True  # whether the garbage collector was on before the server turned it off
    proc_problem: str | None = None  # why workers could not show their own command line in /proc

    def preload(self, modules: list[str]) -> dict:
        """Import `modules`; what to tell torchrun's side."""
        t0 = time.perf_counter()
        self.collecting = gc.isenabled()
        gc.disable()  # no collections between the imports: fewer holes in pages the workers share
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # the workers will import it themselves and report it properly
                return {"error": f"importing {name} failed: {type(e).__name__}: {e}"}
        # What the imports made is never collected (the workers' collections do not write to those
        # pages, which stay shared) and their exit does not walk it: a worker exits in about a third
        # of the time (measured here: 0.6 s against 1.9 s forked without it, 1.4 s fresh).
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        return {"ready": True, "import_s": time.perf_counter() - t0}

    def serve(self) -> Job | None:
        """Fork a worker per request until the socket closes (torchrun is gone). Returns only in a
        forked worker, with what it runs."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 3)
            except ConnectionError:
                return None
            if not message:
                return None  # torchrun closed its end or died
            request = json.loads(message)
            problem = self.problem(request)
            if problem is None:
                try:
                    forked = self.fork_twice(request, fds)
                except OSError as e:
                    problem = f"fork failed: {e}"
                else:
                    if isinstance(forked, Job):
                        return forked
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"error": problem} if problem else {"pid": forked})

    def problem(self, request: dict) -> str | None:
        """Why this worker cannot be forked now, or None."""
        if threading.active_count() > 1:
            return f"the fork server has {threading.active_count()} Python threads"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "CUDA is initialised in the fork server"
        if self.proc_problem:
            return self.proc_problem
        argv_room, env_room = room()
        argv_bytes, env_bytes = (
            len(encode(request["argv"])),
            len(encode(env_strings(request["env"]))),
        )
        if argv_bytes > argv_room or env_bytes > env_room:
            return (
                f"its command line ({argv_bytes} bytes) or environment ({env_bytes} bytes) does "
                "not fit the room the "
                f"fork server reserved ({argv_room}, {env_room})"
            )
        return environment_problem(self.environment, request["env"])

    def fork_twice(self, request: dict, fds: list[int]) -> Job | int:
        """Fork the worker (in it: return its Job) through an intermediate child that exits at once,
        so the worker is adopted by the nearest subreaper (torchrun); in the server: its pid."""
        read, write = os.pipe()
        first = os.fork()
        if first == 0:
            try:
                intermediate = os.getpid()
                worker = os.fork()
            except BaseException:
                os._exit(1)  # the intermediate: nothing of Python's exit (atexit, flushing) runs
            if worker == 0:
                os.close(read)
                os.close(write)
                try:
                    return self.become(request, fds, intermediate)
                except BaseException:  # never back into the server's loop
                    traceback.print_exc()
                    os._exit(1)
            try:
                os.write(write, str(worker).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            pid = f.read()
        os.waitpid(first, 0)  # it has exited: its child is adopted already
        if not pid:
            raise OSError("the intermediate process could not fork the worker")
        return int(pid)

    def become(self, request: dict, fds: list[int], intermediate: int) -> Job:
        """In the forked worker (whose parent was `intermediate`): everything a fresh `python -m`
        started by torchrun would have."""
        # until adopted: from the start, torchrun's child, as a fresh one is
        while os.getppid() == intermediate:
            time.sleep(0.0001)
        os.setsid()  # torchrun starts each worker in a session of its own and signals its group
        self.sock.close()
        if self.collecting:
            gc.enable()
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        for target, fd in zip(request["stdio"], fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        replace_environ(request["env"])
        show_in_proc(request["argv"], request["env"])
        sys.orig_argv = list(request["argv"])
        numpy = sys.modules.get("numpy.random")
        if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
            numpy.seed()
        _, module, args = split_command(request["argv"], request["argv"][0]) or ([], "", [])
        return Job(module, args)


def serve(fd: int, preload: list[str]) -> Job | None:
    """Import `preload`, say so on the socket at `fd`, then fork a worker per request. Returns only
    in a forked worker, with what it runs."""
    handlers: dict[int, Any] = {}
    # torchrun's to pass on, not the server's
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        handlers[sig] = signal.signal(sig, signal.SIG_IGN)
    server = Server(
        socket.socket(fileno=fd), {k: v for k, v in os.environ.items() if k != ROOM_ENV}, handlers
    )
    server.proc_problem = proc_areas_problem()
    replace_environ(server.environment)
    if server.proc_problem is None:
        title = [
            sys.executable,
            "-m",
            "strata.launch.forkserver",
            "(torchrun's worker fork server)",
        ]
        show_in_proc(title, server.environment)
    ready = server.preload(preload)
    try:
        _send(server.sock, ready)
    except OSError:  # torchrun's side let it go before it was ready
        return None
    return server.serve() if "error" not in ready else None


def main(argv: list[str] | None = None) -> Job | None:
    """The fork server's command line (`--fd`, `--preload`, `--room`): serve until torchrun's side
    closes. Returns a forked worker's Job (None in the server)."""
    p = argparse.ArgumentParser(
        prog="python -m strata.launch.forkserver", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--fd", type=int, required=True, help="the socket torchrun's side holds the other end of"
    )
    p.add_argument("--preload", default=",".join(PRELOAD), help="modules to import before forking")
    p.add_argument(
        "--room", default="", help="placeholder reserving room for the workers' command lines"
    )
    args = p.parse_args(argv)
    return serve(args.fd, [m for m in args.preload.split(",") if m])


if __name__ == "__main__":
    job = main()
    # the server, its torchrun gone: nothing of its own to finalise (a torch teardown: ~0.4 s)
    if job is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    job.run()  # in a forked worker: the worker's module as __main__; its exit is the process's
