"""How a test starts more than one process: every multi-process test goes through this module.

In-process gloo worlds (the test's own worker function on N ranks):
    run_world(worker, size, out_dir, *args)   N ranks forked from a preloaded fork server, each running
                                              `worker(rank, size, port, out_dir, *args)`; their results,
                                              or with `exit_codes=True` (ranks expected to fail or be
                                              killed) their exit codes
    join_world(rank, size, port)              a worker's first line: one thread, the gloo world
    worker_env(rank, size, port)              or torchrun's worker environment, for runtime.start()

The `strata` command as a user runs it, to the end:
    strata(*args)                             `python -m strata.launch.cli ARGS`, CompletedProcess
    strata_command(*args)                     that command line, for a wrapper (a namespace node)
    launch_run(data_dir, run_root, nproc, ...) `strata launch` of the tiny experiment, asserted to succeed
    train_run(data_dir, run_root, nproc, ...)  the same run's `strata train` in each rank of an in-process
                                              world (torchrun's worker environment, no launcher): the
                                              layout comparisons, which need the numbers, not the launcher
    train_world(args, nproc, run_root)        `strata train ARGS` that way, for any experiment
    losses_from, final_params, assert_same_params   what such a run left, compared across layouts
    COMMON, ZERO3                             settings those runs share

A peer's world (FSDP2, DeepSpeed) for a comparison:
    torchrun(script, *args, nproc=2)          `python -m torch.distributed.run --standalone ...`, to the end

In the background, to signal, stop or kill it while it runs:
    start_strata(*args, marker=..., log=...)  `strata launch`/`strata train`/`strata store` as a Popen
                                              (`new_session=True`: its own process group, for killpg)
    start(cmd, marker=..., log=...)           any other command the same way (a stand-in launcher, a
                                              command wrapped to run in a namespace node)
    start_agents(paths, secret)               snapshot agents, returned once their sockets exist
    marked_processes(marker, **env)           every live process started under `marker` (descendants too:
                                              torchrun's workers are session leaders, no process group
                                              reaches them), kill_marked(marker) ends them
    wait_for(condition, timeout, what)        poll until a background run reaches a point

Several nodes with their own addresses and links (network namespaces) are tests/cluster.py's."""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strata.net import free_port

TESTS = (
    Path(__file__).resolve().parent
)  # on sys.path (pyproject: pythonpath), as conftest and cluster are
REPO = TESTS.parent
CLI = "strata.launch.cli"
MARKER_ENV = "STRATA_TEST_ID"

# What every world's ranks import, loaded once by the forkserver they are forked from: a spawned
# rank would import torch and Strata anew (seconds each on 2 cores), and forking the test process
# itself would copy whatever threads and state the earlier tests left in it.
# torch._dynamo too: torch.optim's constructors import it (2-3 s on 2 cores), in every rank that builds one.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "strata.parallel.runtime",
    "strata.trainer.parallelize",
    "strata.trainer.jobs",
]

# Settings of the runs compared across layouts (tests/trainer/test_parallelize.py and the features
# composed with parallelism): every step logged, checkpoints and evaluations at steps 3 and 6.
COMMON = {
    "log.interval": 1,
    "checkpoint.save_final": True,
    "checkpoint.interval": 3,
    "train.eval_interval": 3,
}
ZERO3 = {
    "zero.params.shard_over": "global",
    "zero.grads.shard_over": "global",
    "zero.optim.shard_over": "global",
}


# --- in-process gloo worlds ------------------------------------------------------------------------


def run_world(
    worker: Callable,
    size: int,
    out_dir: Path,
    *args,
    timeout_s: float = 120,
    start_method: str = "forkserver",
    exit_codes: bool = False,
    late: str = "",
) -> list:
    """Run `worker(rank, size, port, out_dir, *args)` on `size` processes (they init gloo on
    tcp://127.0.0.1:port); each saves its result to out_dir/rank{rank}.pt, returned in rank order.
    Fails the test if a rank raises or the world outlives `timeout_s` (a hang kills the ranks;
    `late` says what that means).

    With `exit_codes=True` the ranks may fail, exit with a code of their own or be killed: nothing is
    stopped early (a failed rank does not end the others) and the exit codes are returned in rank
    order once every rank has exited. `start_method="fork"` is for a child process that imported
    something slow (megatron) for its ranks to inherit."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    ctx = mp.start_processes(
        worker,
        args=(size, free_port(), str(out_dir), *args),
        nprocs=size,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + timeout_s

    def overdue() -> None:
        for p in ctx.processes:
            p.kill()
        pytest.fail(
            f"world of {size} did not finish within {timeout_s}s{': ' + late if late else ''}"
        )

    if exit_codes:
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                overdue()
            multiprocessing.connection.wait(
                [p.sentinel for p in ctx.processes if p.is_alive()], timeout=0.05
            )
        return [p.exitcode for p in ctx.processes]
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):  # raises if a rank failed
        if time.monotonic() > deadline:
            overdue()
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(size)]


def join_world(rank: int, size: int, port: int, timeout_s: float = 60) -> None:
    """In a `run_world` worker: one thread, and the gloo world on tcp://127.0.0.1:port."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# --- the strata command, to the end ----------------------------------------------------------------


def strata_command(*args: str, module: str = CLI) -> list[str]:
    """`python -m strata.launch.cli ARGS` (or another of Strata's entry modules) as an argv."""
    return [sys.executable, "-m", module, *args]


def strata(
    *args: str, cwd: Path | str = REPO, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`strata ARGS` in a subprocess, as a user runs it, to its end: exit status and text output.
    `env` is added to this process's environment. `timeout` is how long it may stall (no output, no
    computing) before it is taken for a hang: a run slowed by a busy machine goes on."""
    return run_guarded(strata_command(*args), cwd, {**os.environ, **(env or {})}, stall_s=timeout)


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process `pid` and every process below it, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


def run_guarded(
    cmd: list[str],
    cwd: Path | str,
    env: dict[str, str] | None,
    stall_s: float,
    limit_s: float = 3600,
) -> subprocess.CompletedProcess:
    """Run `cmd` to its end like subprocess.run(capture_output=True, text=True), killing it (and every
    process it started) only when it stalls: no output and under 0.5 CPU-second in `stall_s` seconds
    (a hang waits without computing), or past `limit_s` in all. A run that is slow because the machine
    is busy keeps computing, so it is never taken for a hang."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def drain(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    readers = [
        threading.Thread(target=drain, args=(proc.stdout, out["stdout"]), daemon=True),
        threading.Thread(target=drain, args=(proc.stderr, out["stderr"]), daemon=True),
    ]
    for reader in readers:
        reader.start()
    began = last_progress = time.monotonic()
    seen, cpu = 0, 0.0
    while True:
        try:  # returns the moment the process ends (a fixed sleep here cost every run half a second)
            proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        now, lines, used = (
            time.monotonic(),
            len(out["stdout"]) + len(out["stderr"]),
            _tree_cpu_seconds(proc.pid),
        )
        if lines > seen or used > cpu + 0.5:
            seen, cpu, last_progress = lines, used, now
        if now - last_progress > stall_s or now - began > limit_s:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for reader in readers:
                reader.join(5)
            raise subprocess.TimeoutExpired(
                cmd, stall_s, "".join(out["stdout"]), "".join(out["stderr"])
            )
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(
        cmd, proc.returncode, "".join(out["stdout"]), "".join(out["stderr"])
    )


def launch_run(
    data_dir, run_root, nproc: int, *extra: str, **settings
) -> subprocess.CompletedProcess:
    """`strata launch` of the tiny experiment with `settings` on `nproc` processes, writing under
    run_root/t; fails the test (with the output) unless it succeeds."""
    from conftest import tiny_overrides

    experiment = _empty_experiment(run_root)
    proc = strata(
        "launch",
        str(experiment),
        *tiny_overrides(data_dir, run_root, **settings),
        *extra,
        "--nproc",
        str(nproc),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def train_run(data_dir, run_root, nproc: int, *extra: str, **settings) -> str:
    """`strata train` of the tiny experiment with `settings` in each rank of an `nproc`-rank world
    forked from the suite's preloaded fork server, with the environment torchrun gives its workers
    (one thread each when there are several): what a launched worker runs, without the launcher,
    its agent and its own fork server, whose start-up is most of a tiny run's time (`launch_run` and
    tests/launch cover those). Writes under run_root/t; returns every rank's output, rank by rank;
    fails the test (with the output) unless every rank exits 0."""
    from conftest import tiny_overrides

    experiment = _empty_experiment(run_root)
    return train_world(
        [str(experiment), *tiny_overrides(data_dir, run_root, **settings), *extra], nproc, run_root
    )


def train_world(args: list[str], nproc: int, run_root: Path) -> str:
    """`strata train ARGS` in each rank of an `nproc`-rank world as `train_run` runs it (the ranks'
    output kept under run_root/ranks); every rank's output, asserted to have exited 0."""
    out_dir = run_root / "ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    codes = run_world(_train_rank, nproc, out_dir, ["train", *args], timeout_s=600, exit_codes=True)
    output = "".join((out_dir / f"rank{r}.out").read_text() for r in range(nproc))
    assert codes == [0] * nproc, f"exit codes {codes}\n{output[-8000:]}"
    return output


def _empty_experiment(run_root: Path) -> Path:
    run_root.mkdir(parents=True, exist_ok=True)
    experiment = run_root / "experiment.yaml"
    experiment.write_text("{}\n")
    return experiment


def worker_env(rank: int, size: int, port: int) -> None:
    """In a `run_world` worker: the environment torchrun gives worker `rank` of a one-node world
    of `size` whose store is at 127.0.0.1:port (what `runtime.start()` reads)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )


def _train_rank(rank: int, size: int, port: int, out_dir: str, argv: list[str]) -> None:
    """One rank of `train_run`: torchrun's worker environment, output to out_dir/rank{rank}.out, the
    strata command's exit code as the process's."""
    worker_env(rank, size, port)
    if size > 1:  # torchrun's default for several workers on a node
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    with open(f"{out_dir}/rank{rank}.out", "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    from strata.launch.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors, which print their own message
        code = e.code if isinstance(e.code, int) else 1
    except Exception:  # torch's process wrapper would keep the traceback in a queue nobody reads
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def losses_from(run_dir) -> dict[int, float]:
    """step -> training loss, from a run's metrics.jsonl."""
    records = [
        json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def final_params(ckpt_root, step: int = 6) -> dict[str, torch.Tensor]:
    """The model's tensors (global shapes) in the checkpoint of `step` under `ckpt_root`."""
    from strata.checkpoint import store
    from strata.checkpoint.reader import Checkpoint

    return Checkpoint(store.step_dir(ckpt_root, step)).tensors("model.")


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    # Summation order differs between layouts; Adam divides by sqrt(v), which turns that fp32
    # noise in near-zero gradients into parameter differences of up to a few 1e-3·lr (lr = 1e-2;
    # a wrong gradient moves a parameter by ~lr per step).
    for key, ref in want.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{key}: {m}")


def torchrun(
    *target: str,
    nproc: int = 2,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """A peer's script (and its arguments) on `nproc` local processes under torchrun, to its end."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *target,
    ]
    return run_guarded(cmd, cwd, env, stall_s=timeout)


# --- in the background -------------------------------------------------------------------------------


def start(
    cmd: list[str],
    *,
    marker: str | None = None,
    log: Path | None = None,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen:
    """`cmd` in the background. With `marker`, STRATA_TEST_ID=marker is in its environment, so in every
    descendant's: `marked_processes` finds them all, `kill_marked` ends them. Output (stderr with it)
    is appended to `log`, or piped (text) when `log` is None. `env` is added to this process's.
    `new_session`: its own session and process group (os.killpg(proc.pid, ...) reaches it and the
    children that stay in its group)."""
    environ = {**os.environ, **(env or {}), **({MARKER_ENV: marker} if marker else {})}
    kwargs = {
        "cwd": cwd,
        "env": environ,
        "stderr": subprocess.STDOUT,
        "start_new_session": new_session,
    }
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kwargs)
    with open(log, "ab") as out:  # the child has its own descriptor
        return subprocess.Popen(cmd, stdout=out, **kwargs)


def start_strata(
    *args: str,
    marker: str | None = None,
    log: Path | None = None,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen:
    """`strata ARGS` (`launch`, `train`, `store`, ...) in the background, as `start` starts a command."""
    return start(
        strata_command(*args), marker=marker, log=log, cwd=cwd, env=env, new_session=new_session
    )


def start_agents(sockets: list[str], secret: str, timeout_s: float = 20) -> list[subprocess.Popen]:
    """One snapshot agent (`python -m strata.launch.snapshot_agent`) per socket path, on 127.0.0.1,
    started together and returned once every socket exists."""
    procs = []
    for path in sockets:
        cmd = strata_command(
            "--socket",
            path,
            "--advertise",
            "127.0.0.1",
            "--bind",
            "127.0.0.1",
            module="strata.launch.snapshot_agent",
        )
        env = {**os.environ, "STRATA_SNAPSHOT_SECRET": secret}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + timeout_s
    for path in sockets:
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "agent did not start"
            time.sleep(0.02)
    return procs


def marked_processes(marker: str, **env: str) -> list[int]:
    """Pids of live processes whose environment has STRATA_TEST_ID=marker and every `env` item
    (torchrun starts each worker in a session of its own, so process groups do not find them)."""
    want = [f"{MARKER_ENV}={marker}".encode()] + [f"{k}={v}".encode() for k, v in env.items()]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            items = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(w in items for w in want):
            found.append(int(entry.name))
    return found


def kill_marked(marker: str, **env: str) -> None:
    """SIGKILL every live process `marked_processes(marker, **env)` finds."""
    for pid in marked_processes(marker, **env):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until `condition()` held (polled every 50 ms); fails after `timeout`."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - began
