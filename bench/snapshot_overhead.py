"""In-memory snapshots: what a snapshot every step costs, against disk checkpoints of the
same state, how fast the erasure code is against a memcpy, and how long a worker crash takes to
recover from (docs/design/snapshot.md §8). Goals: snapshot stall < 5 % of the step; a snapshot
much cheaper to take than a checkpoint (the paper: > 14x faster saving than async checkpointing).

Every job is the demo model (configs/tiny.yaml, 0.89M parameters, 16x128 tokens a step, micro-batch
4) run by `strata launch` on `--nodes` simulated nodes x `--nproc` ranks (default 2 x 2, the fault
tests' set-up: a standalone `strata store`, c10d rendezvous, one snapshot agent per node, k=1, m=1;
`--nodes 1` runs one node with m=0). Rank 0's metrics.jsonl gives the step time per log interval
(`step_time_s`, which includes that interval's snapshots or saves) and the snapshot stall
(`snapshot.stall_ms`: `SnapshotManager.save`, which collects the pieces through `TrainState.contents`
too, mean per interval); the first interval (start-up,
first plan and lease) is dropped, each run is the median of its intervals, each variant the median
of its runs. The variants, one job each, in alternating order (off, snap, sync, async, then the
pairs reversed) so that drift of the shared machine's load falls on both sides:

* off: no snapshots, no checkpoints until the end (`checkpoint.save_final=false`: none at all);
* snap: `snapshot.every_steps=1`;
* sync / async: `checkpoint.interval=1`, `checkpoint.async=false` / `true`, no snapshots.

Reported: the median snapshot stall and stall / step (goal < 5 %), the step time ratio snap/off,
each disk save's cost (its job's step time minus off's) next to the snapshot's, and the CPU time a
step summed over the job's processes per role (workers, agents, checkpoint writers; /proc, between
two metrics records): on 2 cores that CPU, not waiting, is what sets the step time. `--breakdown`
(default on) also times the pieces of every snapshot and save in every rank by wrapping functions
from a generated sitecustomize.py on the workers' PYTHONPATH (no product file changes; a wrapper
costs about a microsecond): the whole `Trainer.snapshot` / `Trainer.save` call (wall and process
CPU), `SnapshotManager.save`, collecting the pieces (`TrainState.contents`), settling the previous
snapshot, the lease round trip to the agent, the copy (`stage`), starting the all-reduce that
agrees on the plan and the lease, and in the background thread the wait for that agreement and
the commit round trip; for checkpoints, the wait for the previous save and the copy. The headline
stall ratio checkpoint / snapshot uses those timed calls.

In this process, before the jobs: ISA-L encode and decode (m data fragments dropped) GB/s of a
`--codec-mib` image for Code(1,1), (2,1) and (4,2), against numpy.copyto and torch copy_ of the same
bytes (best and median of `--reps`; GB/s are image bytes per second), and the agent's placement
path (CRC-32C, encode into a fresh bytearray) at one rank's image size; during the snap jobs the
agents' own `encode_gbps` (op "stats") is read over their sockets. Part "pieces": one rank's
per-snapshot work (collect the pieces, check them against the plan, copy them, rank 0's trailer)
timed in this process with nothing running beside it, against the same work done from scratch (the
pieces made anew, their descriptors compared, the views sliced anew) and one memcpy of the image's
bytes.

MTTR: a job of the same shape (k=1, m=1; --max-restarts 3, join timeout 30, log interval 1) whose worker with
RANK=1 gets SIGKILL (`--mttr-fault stop`: SIGSTOP, a hang the watchdog must find within `--hang-timeout`)
once rank 0 has logged step `--kill-step`, run once per `strata launch --worker-start` in
`--mttr-starts` (fresh: plain torchrun starts a new Python per worker, the peer; forkserver: the
workers are forks of a per-node process that imported torch and Strata once), `--mttr-repeats`
times, alternating. Reported from the kill: the first torchrun message, when the old workers have
all exited, the restarted worker processes (/proc start time), the restarted workers' events
(breakdown: imports done as `runtime.start` is called, init_process_group done, Trainer built), the
`resumed` record (restart + restore done), the first step logged after it (training resumed; goal
<= 3 s), and the trainer's own `restore_s`. The job must exit 0 and log "resumed from in-memory step".

Every process started gets STRATA_BENCH_ID in its environment and is SIGKILLed through a /proc scan
at the end, whatever happens (torchrun starts each worker in a session of its own).

    python bench/snapshot_overhead.py                     # 2 nodes x 2 ranks: about 4 min on 2 idle cores
    python bench/snapshot_overhead.py --parts codec       # the codec table only, a few seconds
    python bench/snapshot_overhead.py --nodes 1 --repeats 3 --parts stall
    python bench/snapshot_overhead.py --parts mttr --mttr-fault stop   # a frozen rank: verdict, restart
    python bench/snapshot_overhead.py --parts mttr --mttr-repeats 3    # MTTR, fresh against forked workers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
from strata.checkpoint.agent_protocol import SOCKET_ENV, agent_stats  # noqa: E402
from strata.checkpoint.erasure import Code  # noqa: E402
from strata.data.prepare import ensure_default_corpus  # noqa: E402
from strata.launch.torchrun import SECRET_ENV  # noqa: E402
from strata.net import free_port  # noqa: E402

MARKER = "STRATA_BENCH_ID"
STALL_GOAL = 0.05
PAPER_SAVE_RATIO = 14.0
PARTS = ("codec", "pieces", "stall", "disk", "mttr")

# Loaded by every Python process of the jobs (PYTHONPATH); patches only the workers' modules, on import.
SITECUSTOMIZE = r"""
import atexit, importlib.abc, importlib.util, json, os, sys, time
_OUT = os.environ.get("STRATA_BENCH_TIMINGS")
_D = {}
_START = time.time()

def _rank():  # read when needed: a worker forked from the fork server gets its RANK after the fork
    return os.environ.get("RANK")

def _event(name):
    with open(os.path.join(_OUT, f"events-{_rank()}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"ev": name, "t": time.time(), "rank": int(_rank()),
                            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")

def _timed(name, fn, events=False, cpu=False):
    def wrapper(*a, **k):
        if events:
            _event(name + ":start")
        c, t = time.process_time() if cpu else 0.0, time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _D.setdefault(name, []).append(time.perf_counter() - t)
            if cpu:  # the process's CPU time over the call, every thread (gloo's included)
                _D.setdefault(name + " (cpu)", []).append(time.process_time() - c)
            if events:
                _event(name + ":end")
    return wrapper

def _snapshot(mod):
    mod.SnapshotManager.save = _timed("save", mod.SnapshotManager.save)
    mod.SnapshotManager._settle = _timed("settle", mod.SnapshotManager._settle)
    mod.SnapshotManager._finish = _timed("background_finish", mod.SnapshotManager._finish)
    mod.stage = _timed("stage", mod.stage)
    req = mod.request
    def request(sock, msg):
        t = time.perf_counter()
        try:
            return req(sock, msg)
        finally:
            _D.setdefault("rpc_" + str(msg.get("op")), []).append(time.perf_counter() - t)
    mod.request = request
    comm = mod.comm
    class Comm:
        def __getattr__(self, name):
            return getattr(comm, name)
        all_reduce = staticmethod(_timed("all_reduce", comm.all_reduce))
        all_reduce_async = staticmethod(_timed("all_reduce_async", comm.all_reduce_async))
    mod.comm = Comm()

def _loop(mod):
    T = mod.Trainer
    T.__init__ = _timed("trainer_init", T.__init__, events=True)
    T.snapshot = _timed("trainer_snapshot", T.snapshot, cpu=True)
    T.save = _timed("trainer_save", T.save, cpu=True)
    T.train_step = _timed("train_step", T.train_step, cpu=True)

def _state(mod):
    mod.TrainState.contents = _timed("state_to_save", mod.TrainState.contents)

def _manager(mod):
    M = mod.CheckpointManager
    M.save = _timed("ckpt_save", M.save)
    M.wait = _timed("ckpt_wait", M.wait)
    M.poll = _timed("ckpt_poll", M.poll)
    mod.stage = _timed("ckpt_stage", mod.stage)

def _runtime(mod):
    mod.start = _timed("runtime_start", mod.start, events=True)

_PATCH = {"strata.checkpoint.snapshot": _snapshot, "strata.trainer.loop": _loop, "strata.trainer.state": _state,
          "strata.parallel.runtime": _runtime, "strata.checkpoint.manager": _manager}

class _Finder(importlib.abc.MetaPathFinder):
    busy = set()
    def find_spec(self, name, path=None, target=None):
        patch = _PATCH.get(name)
        if patch is None or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            patch(module)
        spec.loader.exec_module = exec_module
        return spec

def _dump():
    if _rank() is None:  # the fork server
        return
    with open(os.path.join(_OUT, f"timings-{_rank()}-{os.getpid()}.json"), "w") as f:
        json.dump({"rank": int(_rank()), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   "durations": _D}, f)

# torchrun's workers only, and the fork server they are forked from (strata launch's default), which
# imports the patched modules for them
if _OUT and (os.environ.get("LOCAL_RANK") is not None or "STRATA_FORKSERVER_ROOM" in os.environ):
    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump)
    if _rank() is not None:
        _event("process")
"""


# --- statistics ------------------------------------------------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def fmt(x, spec=".2f", unit=""):
    return "n/a" if x is None else f"{x:{spec}}{unit}"


# --- processes ---------------------------------------------------------------------------------


def environ_of(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state == "Z":
        return None
    return dict(
        item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item
    )


def processes(marker: str, **env: str) -> dict[int, dict[str, str]]:
    """Live processes (pid -> environment) with STRATA_BENCH_ID=marker and every `env` item."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        e = environ_of(int(entry))
        if e is not None and e.get(MARKER) == marker and all(e.get(k) == v for k, v in env.items()):
            found[int(entry)] = e
    return found


def kill(pids, sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def start_time(pid: int) -> float | None:
    """A process's start, wall clock (10 ms resolution). The boot time is now less the uptime:
    /proc/stat's btime is whole seconds, which put starts up to a second early."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return booted + ticks / os.sysconf("SC_CLK_TCK")


ROLES = (
    ("agent", "strata.launch.snapshot_agent"),
    ("writer", "strata.checkpoint.writer"),
    ("torchrun", "torch.distributed.run"),
    ("torchrun", "strata.launch.elastic"),  # torchrun with the fork server
    ("forkserver", "strata.launch.forkserver"),
    ("worker", "launch.cli train"),
    ("launcher", "launch.cli launch"),
    ("store", "launch.cli store"),
)


def cpu_by_role(marker: str, job: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the job's live processes, summed per role."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in processes(marker, STRATA_BENCH_JOB=job):
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = next((r for r, needle in ROLES if needle in cmd), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class Job:
    """One Strata job: a standalone store (2+ nodes) and `--nodes` `strata launch`es, their output
    time-stamped line by line into <dir>/<node>.log."""

    def __init__(
        self,
        args,
        marker: str,
        name: str,
        root: Path,
        settings: dict,
        max_restarts: int = 0,
        breakdown: bool = True,
    ):
        self.args, self.name, self.marker = args, name, marker
        self.dir = root / name
        (self.dir / "timings").mkdir(parents=True)
        (self.dir / "tmp").mkdir()
        overrides = {
            "train.steps": args.steps,
            "train.micro_batch_size": args.micro_batch,
            "optim.warmup_steps": 5,
            "train.eval_interval": 0,
            "checkpoint.save_final": "false",
            "log.progress": "false",
            "log.interval": args.log_interval,
            "log.dir": self.dir / "runs",
            "log.name": "t",
            "snapshot.every_steps": 0,
            "parallel.timeout_s": 60,
            **settings,
        }
        self.metrics_path = self.dir / "runs" / "t" / "metrics.jsonl"
        pythonpath = [str(root / "site")] if breakdown else []
        self.env = {
            **os.environ,
            MARKER: marker,
            "STRATA_BENCH_JOB": name,
            "TMPDIR": str(self.dir / "tmp"),
            # the timing wrappers' sitecustomize only: the workers import the installed strata
            "PYTHONPATH": os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]),
            "STRATA_BENCH_TIMINGS": str(self.dir / "timings"),
            SECRET_ENV: os.urandom(32).hex(),
            "PYTHONUNBUFFERED": "1",
        }
        self.launch = [
            "launch",
            str(REPO / "configs" / "tiny.yaml"),
            *[f"{k}={v}" for k, v in overrides.items()],
            "--nproc",
            str(args.nproc),
            "--max-restarts",
            str(max_restarts),
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: list[
            tuple[float, str, str]
        ] = []  # (time, node, line) of every launcher's output
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _spawn(self, node: str, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.launch.cli", *args],
            cwd=REPO,
            env={**self.env, "STRATA_BENCH_NODE": node},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        log = open(self.dir / f"{node}.log", "w")

        def pump():
            with log:
                for raw in proc.stdout:
                    now, line = time.time(), raw.decode(errors="replace").rstrip("\n")
                    with self._lock:
                        self.lines.append((now, node, line))
                    log.write(f"{now:.3f} {line}\n")
                    log.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self._threads.append(t)
        self.procs[node] = proc
        return proc

    def start(self) -> None:
        self.t0 = time.time()
        if self.args.nodes == 1:
            self._spawn("A", self.launch)
            return
        port = free_port()
        self._spawn("store", ["store", "--host", "127.0.0.1", "--port", str(port)])
        deadline = time.monotonic() + 60
        while True:  # the store listens before any node tries to join
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError as e:
                if time.monotonic() > deadline or self.procs["store"].poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: the rendezvous store did not start; see {self.dir}/store.log"
                    ) from e
                time.sleep(0.1)
        for node in "ABCDEFGH"[: self.args.nodes]:
            self._spawn(
                node,
                self.launch
                + [
                    "--nnodes",
                    str(self.args.nodes),
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-store",
                    "external",
                    "--rdzv-id",
                    f"bench-{self.name}",
                    "--join-timeout",
                    "30",
                ],
            )

    def nodes(self) -> list[str]:
        return [n for n in self.procs if n != "store"]

    def records(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        out = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return out

    def wait(self, until=None, timeout: float | None = None) -> None:
        """Until every node exits (or `until()` holds); a node failing or the deadline raises."""
        deadline = time.monotonic() + (timeout or self.args.job_timeout)
        while True:
            if until is not None and until():
                return
            codes = {n: self.procs[n].poll() for n in self.nodes()}
            bad = {n: c for n, c in codes.items() if c not in (None, 0)}
            if bad:
                raise RuntimeError(
                    f"{self.name}: node(s) {bad} failed; see {self.dir}/*.log:\n{self.tail()}"
                )
            if until is None and all(c == 0 for c in codes.values()):
                for t in self._threads:
                    t.join(timeout=5)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: no {'end' if until is None else 'progress'} within the deadline; "
                    f"see {self.dir}/*.log:\n{self.tail()}"
                )
            time.sleep(0.05)

    def tail(self, n: int = 30) -> str:
        with self._lock:
            return "\n".join(f"{t:.3f} [{node}] {line}" for t, node, line in self.lines[-n:])

    def text(self) -> str:
        with self._lock:
            return "\n".join(line for _, _, line in self.lines)

    def close(self) -> None:
        for _ in range(3):  # again, in case a torchrun was starting workers while we looked
            pids = processes(self.marker, STRATA_BENCH_JOB=self.name)
            if not pids:
                break
            kill(pids)
            time.sleep(0.2)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def timings(self) -> list[dict]:
        return [
            json.loads(p.read_text()) for p in sorted((self.dir / "timings").glob("timings-*.json"))
        ]

    def events(self) -> list[dict]:
        out = []
        for p in sorted((self.dir / "timings").glob("events-*.jsonl")):
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out


def agents_stats(marker: str, job: str) -> list[dict]:
    """Every agent of the job's op "stats", reached through the socket its workers were given."""
    sockets = sorted(
        {e[SOCKET_ENV] for e in processes(marker, STRATA_BENCH_JOB=job).values() if SOCKET_ENV in e}
    )
    out = []
    for path in sockets:
        try:
            out.append(agent_stats(path))
        except OSError as e:
            out.append({"error": str(e)})
    return out


# --- part 3: the codec, in this process ----------------------------------------------------------


def best_and_median(fn, reps: int) -> tuple[float, float]:
    fn()  # warm: pages, tables, the thread pool
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def codec_bench(mib: int, reps: int, image_bytes: int) -> list[dict]:
    n = mib << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.empty_like(src)
    rows = []

    def row(what, times):
        best, med = times
        rows.append({"what": what, "best_gbps": n / best / 1e9, "median_gbps": n / med / 1e9})
        print(
            f"  {what:<28} best {n / best / 1e9:6.2f} GB/s   median {n / med / 1e9:6.2f} GB/s",
            flush=True,
        )

    row("numpy.copyto", best_and_median(lambda: np.copyto(dst, src), reps))
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    row(
        f"torch copy_ ({torch.get_num_threads()} threads)",
        best_and_median(lambda: td.copy_(ts), reps),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        row("torch copy_ (1 thread)", best_and_median(lambda: td.copy_(ts), reps))
    finally:
        torch.set_num_threads(threads)
    for k, m in ((1, 1), (2, 1), (4, 2)):
        code = Code(k, m)
        frag = code.fragment_len(n)
        image = np.zeros(frag * k, np.uint8)
        image[:n] = src
        data = [image[i * frag : (i + 1) * frag] for i in range(k)]
        parity = [np.empty(frag, np.uint8) for _ in range(m)]
        row(f"Code({k},{m}) encode", best_and_median(lambda: code.encode(data, parity), reps))
        lost = list(range(min(m, k)))  # m data fragments gone: decoding has to invert
        have = {j: data[j] for j in range(k) if j not in lost} | {
            k + i: parity[i] for i in range(m)
        }
        want = {j: np.empty(frag, np.uint8) for j in lost}
        row(
            f"Code({k},{m}) decode (lose {len(lost)})",
            best_and_median(lambda: code.decode(have, want), reps),
        )
        if not all(np.array_equal(want[j], data[j]) for j in lost):
            raise RuntimeError(f"Code({k},{m}) did not rebuild the dropped fragments")
    # The agent's placement path for one rank's image: a CRC-32C, then encode into a fresh bytearray.
    import crc32c

    small = image_bytes
    code = Code(1, 1)
    frag = code.fragment_len(small)
    img = np.zeros(frag, np.uint8)
    img[:small] = src[:small]
    pre = np.empty(frag, np.uint8)
    for what, fn in (
        (f"crc32c, {small / 1e6:.1f} MB", lambda: crc32c.crc32c(img[:small])),
        (f"Code(1,1) encode, {small / 1e6:.1f} MB", lambda: code.encode([img], [pre])),
        ("  same, fresh bytearray parity", lambda: code.encode([img], [bytearray(frag)])),
    ):
        best, med = best_and_median(fn, reps * 5)
        rows.append(
            {"what": what, "best_gbps": small / best / 1e9, "median_gbps": small / med / 1e9}
        )
        print(
            f"  {what:<28} best {small / best / 1e9:6.2f} GB/s   median {small / med / 1e9:6.2f} GB/s",
            flush=True,
        )
    return rows


# --- the per-snapshot work of one rank, quiet, in this process --------------------------------------


def pieces_bench(args, root: Path) -> list[dict]:
    """What a snapshot does on one rank besides waiting, timed in this process with nothing else
    running in it: a world-1 Trainer of the same model; the staging plan is rank 0's of the jobs'
    world (every rank holds the same replicated pieces, so the plan splits each among the ranks)."""
    import json as json_mod

    from strata import config as config_mod
    from strata.checkpoint.pieces import (
        model_pieces,
        optimizer_entries,
        optimizer_pieces,
        rng_piece,
    )
    from strata.checkpoint.stage import (
        copy_pieces,
        descriptors,
        image_views,
        index_of,
        objects_blob,
        plan_staging,
    )
    from strata.checkpoint.stage import stage as stage_views
    from strata.parallel import runtime as runtime_mod
    from strata.trainer.loop import Trainer

    world = args.nodes * args.nproc
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (torchrun sets OMP_NUM_THREADS=1)
    try:
        cfg = config_mod.load(
            str(REPO / "configs" / "tiny.yaml"),
            [
                f"train.micro_batch_size={args.micro_batch}",
                "train.eval_interval=0",
                "checkpoint.save_final=false",
                f"log.dir={root / 'pieces'}",
                "log.progress=false",
            ],
            world_size=1,
        )
        trainer = Trainer(cfg, runtime_mod.start("gloo", 60))
        trainer.train_step()  # the optimizer state exists
        contents = trainer.state.contents(trainer.step)
        pieces, objects, aliases = contents.pieces, contents.objects, contents.aliases
        descs = descriptors(pieces)
        staging = plan_staging([descs] * world, 0)
        image = torch.empty(staging.nbytes, dtype=torch.uint8)
        views = image_views(image, staging.items)
        assert staging.sources.take(pieces)
        flat_src = torch.empty(staging.nbytes, dtype=torch.uint8)
        layout = contents.layout
        m = trainer.model
        rows = []
        print(
            f"  rank 0 of world {world}: {len(pieces)} pieces, {len(staging.items)} items, "
            f"{staging.nbytes / 1e6:.2f} MB image",
            flush=True,
        )

        def made_anew() -> list:
            entries = optimizer_entries(m.engine, m.canonical)
            return (
                model_pieces(m.engine, m.canonical)
                + optimizer_pieces(m.optimizer, entries)
                + [rng_piece(0)]
            )

        def take_fresh() -> bool:  # a new RNG piece, as at every save
            return staging.sources.take(trainer.state.contents(trainer.step).pieces)

        for what, fn in (
            ("TrainState.contents (cached pieces)", lambda: trainer.state.contents(trainer.step)),
            ("  the pieces made anew", made_anew),
            ("contents + Sources.take (plan holds?)", take_fresh),
            ("  descriptors(pieces) compared", lambda: descriptors(pieces) == descs),
            ("stage (views made once per plan)", lambda: stage_views(views, staging.sources)),
            (
                "  copy_pieces (views sliced anew)",
                lambda: copy_pieces(image, staging.items, pieces),
            ),
            ("  one memcpy of the image's bytes", lambda: image.copy_(flat_src)),
            ("rank 0's trailer, index cached", lambda: json_mod.dumps(objects_blob(objects)[1])),
            (
                "  the index, once per plan",
                lambda: json_mod.dumps(index_of(1, layout, staging, {}, aliases)),
            ),
        ):
            best, med = best_and_median(fn, args.reps * 20)
            rows.append({"what": what, "best_ms": 1e3 * best, "median_ms": 1e3 * med})
            print(
                f"  {what:<40} best {1e3 * best:7.3f} ms   median {1e3 * med:7.3f} ms", flush=True
            )
        return rows
    finally:
        torch.set_num_threads(threads)


# --- parts 1 and 2: the step-time jobs ------------------------------------------------------------

VARIANT_SETTINGS = {
    "off": {},
    "snap": {"snapshot.every_steps": 1},
    "sync": {"checkpoint.interval": 1, "checkpoint.async": "false", "checkpoint.keep_last": 2},
    "async": {"checkpoint.interval": 1, "checkpoint.async": "true", "checkpoint.keep_last": 2},
}


def schedule(args) -> list[str]:
    """off, snap, sync, async, then reversed rounds: ABBA against drift."""
    want = [
        v for v in ("off", "snap") if "stall" in args.parts or (v == "off" and "disk" in args.parts)
    ]
    disk = [v for v in ("sync", "async") if "disk" in args.parts]
    out = []
    for r in range(max(args.repeats, args.disk_repeats if disk else 0)):
        rnd = (want if r < args.repeats else []) + (disk if r < args.disk_repeats else [])
        out += rnd if r % 2 == 0 else rnd[::-1]
    return out


def run_variant(args, marker: str, root: Path, variant: str, i: int) -> dict:
    settings = dict(VARIANT_SETTINGS[variant])
    if variant == "snap":
        settings.update({"snapshot.k": 1, "snapshot.m": 1 if args.nodes > 1 else 0})
    job = Job(args, marker, f"{variant}-{i}", root, settings, breakdown=args.breakdown)
    print(
        f"  [{time.strftime('%H:%M:%S')}] {job.name}: starting (load {os.getloadavg()[0]:.2f})",
        flush=True,
    )
    stats, samples = [], []
    first = args.log_interval * args.skip_intervals
    late = max(
        first + args.log_interval, (int(args.steps * 0.8) // args.log_interval) * args.log_interval
    )

    def logged() -> int:
        return max((r["step"] for r in job.records() if "loss" in r), default=0)

    try:
        job.start()
        for at in (first, late):  # CPU time per role between two records, just as each is written
            job.wait(until=lambda: logged() >= at)
            samples.append((logged(), time.time(), cpu_by_role(marker, job.name)))
        if variant == "snap":  # the agents' own counters, late in the run
            stats = agents_stats(marker, job.name)
        job.wait()
    finally:
        job.close()
    (s0, t0, c0), (s1, t1, c1) = samples
    cpu = {role: 1e3 * (c1.get(role, 0.0) - c0.get(role, 0.0)) / max(s1 - s0, 1) for role in c1}
    recs = [r for r in job.records() if "step_time_s" in r]
    measured = [r for r in recs if r["step"] > args.log_interval * args.skip_intervals]
    if not measured:
        raise RuntimeError(
            f"{job.name}: no step records past the skipped intervals in {job.metrics_path}"
        )
    out = {
        "name": job.name,
        "variant": variant,
        "wall_s": time.time() - job.t0,
        "step_s": median([r["step_time_s"] for r in measured]),
        "step_s_intervals": [r["step_time_s"] for r in measured],
        "stall_ms": median([r["snapshot"]["stall_ms"] for r in measured if r.get("snapshot")]),
        "stall_ms_intervals": [r["snapshot"]["stall_ms"] for r in measured if r.get("snapshot")],
        "skipped": max([r["snapshot"]["skipped"] for r in recs if r.get("snapshot")], default=None),
        "agents": stats,
        "timings": job.timings(),
        "cpu_ms_per_step": cpu,
        "cpu_window": [s0, s1, (t1 - t0) / max(s1 - s0, 1)],
    }
    print(
        f"  [{time.strftime('%H:%M:%S')}] {job.name}: step {fmt(1e3 * out['step_s'], '.1f', ' ms')}"
        + (
            f", stall {fmt(out['stall_ms'], '.2f', ' ms')}, skipped {out['skipped']}"
            if variant == "snap"
            else ""
        )
        + f" ({out['wall_s']:.0f} s)",
        flush=True,
    )
    return out


def breakdown_of(runs: list[dict], per_step: int) -> dict:
    """name -> [median over every rank's calls (ms), p95, max over ranks of the rank's median], per call."""
    per_rank: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for t in run["timings"]:
            for name, ds in t["durations"].items():
                per_rank.setdefault(name, {}).setdefault(t["rank"], []).extend(ds)
    out = {}
    for name, ranks in per_rank.items():
        every = [
            d for ds in ranks.values() for d in ds[per_step:]
        ]  # the first interval out, as above
        if every:
            out[name] = {
                "median_ms": 1e3 * median(every),
                "p95_ms": 1e3 * pct(every, 0.95),
                "worst_rank_median_ms": 1e3
                * max(median(ds[per_step:] or ds) for ds in ranks.values()),
                "rank0_median_ms": 1e3 * median(ranks[0][per_step:] or ranks[0])
                if 0 in ranks
                else None,
                "calls": len(every),
            }
    return out


# --- part 4: MTTR ---------------------------------------------------------------------------------


MTTR_GOAL_S = 3.0
MTTR_KEYS = (
    "first_message_s",
    "old_workers_gone_s",
    "first_restart_process_s",
    "last_restart_process_s",
    "imports_done_s",
    "process_group_s",
    "trainer_built_s",
    "resumed_s",
    "first_step_s",
    "restore_s",
    "verdict_s",
)


def mttr(args, marker: str, root: Path) -> dict:
    """One MTTR job per worker start (`strata launch --worker-start`) and repeat, alternating (the
    peer, plain torchrun's fresh workers, first), and each figure's median per start."""
    runs = []
    for i in range(args.mttr_repeats):
        starts = args.mttr_starts if i % 2 == 0 else args.mttr_starts[::-1]
        runs += [mttr_run(args, marker, root, start, i + 1) for start in starts]
    by_start = {
        start: {
            key: median([r[key] for r in runs if r["worker_start"] == start]) for key in MTTR_KEYS
        }
        for start in args.mttr_starts
    }
    return {
        "runs": runs,
        "by_start": by_start,
        "fault": runs[0]["fault"],
        "hang_timeout_s": runs[0]["hang_timeout_s"],
    }


def mttr_run(args, marker: str, root: Path, start: str, i: int) -> dict:
    settings = {
        "snapshot.every_steps": 1,
        "snapshot.k": 1,
        "snapshot.m": 1 if args.nodes > 1 else 0,
    }
    settings["parallel.backend"] = "gloo"  # CPU workers, also on a machine with a GPU
    fault = signal.SIGSTOP if args.mttr_fault == "stop" else signal.SIGKILL
    if fault == signal.SIGSTOP:
        settings["parallel.hang_timeout_s"] = args.hang_timeout
    run_args = argparse.Namespace(**{**vars(args), "steps": args.mttr_steps, "log_interval": 1})
    name = f"mttr-{start}-{i}"
    job = Job(run_args, marker, name, root, settings, max_restarts=3, breakdown=args.breakdown)
    job.launch += ["--worker-start", start]
    print(
        f"  [{time.strftime('%H:%M:%S')}] {name}: starting (load {os.getloadavg()[0]:.2f})",
        flush=True,
    )
    gone: list[float] = []

    def old_workers_gone(old: set[int]) -> bool:
        if not gone and all(
            environ_of(pid) is None for pid in old
        ):  # None: exited (a zombie) or reaped
            gone.append(time.time())
        return any("resumed" in r for r in job.records())

    try:
        job.start()
        job.wait(
            until=lambda: any(
                r.get("step", 0) >= args.kill_step and "loss" in r for r in job.records()
            )
        )
        victims = processes(marker, STRATA_BENCH_JOB=name, RANK="1")
        if len(victims) != 1:
            raise RuntimeError(f"{name}: expected one worker with RANK=1, found {sorted(victims)}")
        before = processes(marker, STRATA_BENCH_JOB=name)
        old = {pid for pid, e in before.items() if "LOCAL_RANK" in e}
        step_at_kill = max(r["step"] for r in job.records() if "loss" in r)
        t_kill = time.time()
        kill(victims, fault)
        print(
            f"  [{time.strftime('%H:%M:%S')}] {name}: {fault.name} worker RANK=1 (pid {next(iter(victims))}) "
            f"after step {step_at_kill}",
            flush=True,
        )
        job.wait(until=lambda: old_workers_gone(old))
        restarted = {
            pid: start_time(pid)
            for pid, e in processes(marker, STRATA_BENCH_JOB=name).items()
            if pid not in before and "LOCAL_RANK" in e
        }
        job.wait()
        codes = {n: job.procs[n].returncode for n in job.nodes()}
    finally:
        job.close()
    recs = job.records()
    resumed = next(r for r in recs if "resumed" in r)
    after = [r for r in recs if "loss" in r and r["time"] > resumed["wall_time"]]
    first_step = after[0] if after else None
    text = job.text()
    later = [
        t
        for t, node, line in job.lines
        if t > t_kill
        and node != "store"
        and line.strip()
        and not line.startswith("*")
        and "OMP_NUM_THREADS" not in line
    ]
    ev = [e for e in job.events() if e["restart"] > 0]

    def ev_time(name, pick=max):
        ts = [e["t"] for e in ev if e["ev"] == name]
        return pick(ts) - t_kill if ts else None

    starts = [t for t in restarted.values() if t is not None]
    hang = [t for t, node, line in job.lines if t > t_kill and "hang: rank" in line]
    out = {
        "worker_start": start,
        "fault": fault.name,
        "hang_timeout_s": args.hang_timeout if fault == signal.SIGSTOP else None,
        "verdict_s": hang[0] - t_kill if hang else None,
        "step_at_kill": step_at_kill,
        "resumed_step": resumed["step"],
        "resumed": resumed["resumed"],
        "restore_s": resumed["restore_s"],
        "first_message_s": later[0] - t_kill if later else None,
        "old_workers_gone_s": gone[0] - t_kill if gone else None,
        "first_restart_process_s": min(starts) - t_kill if starts else None,
        "last_restart_process_s": max(starts) - t_kill if starts else None,
        "imports_done_s": ev_time("runtime_start:start"),
        "process_group_s": ev_time("runtime_start:end"),
        "restarted_workers": len(starts),
        "trainer_built_s": ev_time("trainer_init:end"),
        "resumed_s": resumed["wall_time"] - t_kill,
        "first_step_s": first_step["time"] - t_kill if first_step else None,
        "first_step": first_step["step"] if first_step else None,
        "exit_codes": codes,
        "in_memory": "resumed from in-memory step" in text,
        "forked": sum(
            not part.split(")")[0].endswith("restart 0")
            for part in text.split("strata: worker pid")[1:]
        ),
        "log_excerpt": [
            line for line in text.splitlines() if "snapshot:" in line or "resumed" in line
        ][:6],
        "load_after": os.getloadavg()[0],
    }
    print(
        f"  [{time.strftime('%H:%M:%S')}] {name}: first step {fmt(out['first_step_s'])} s after the signal "
        f"(load {out['load_after']:.2f})",
        flush=True,
    )
    return out


# --- the report -------------------------------------------------------------------------------------


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("  " + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  " + "-+-".join("-" * w for w in widths))
    for r in rows:
        print("  " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--parts", default=",".join(PARTS), help="which of " + ",".join(PARTS) + " to run"
    )
    p.add_argument(
        "--nodes", type=int, default=2, help="simulated nodes (1: one node, snapshot.m=0)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--steps", type=int, default=60, help="steps per step-time job")
    p.add_argument(
        "--micro-batch", type=int, default=4, help="train.micro_batch_size (16 sequences a step)"
    )
    p.add_argument("--log-interval", type=int, default=10, help="steps per metrics record")
    p.add_argument(
        "--skip-intervals", type=int, default=1, help="leading metrics records dropped (start-up)"
    )
    p.add_argument("--repeats", type=int, default=2, help="jobs each of off and snap")
    p.add_argument(
        "--disk-repeats", type=int, default=1, help="jobs each of sync and async checkpoints"
    )
    p.add_argument("--mttr-steps", type=int, default=40, help="steps of the MTTR job")
    p.add_argument(
        "--mttr-starts",
        default="fresh,forkserver",
        help="MTTR: one job per `strata launch --worker-start` value, in this order (reversed every other repeat)",
    )
    p.add_argument("--mttr-repeats", type=int, default=1, help="MTTR: jobs per worker start")
    p.add_argument(
        "--kill-step", type=int, default=20, help="MTTR: signal rank 1 once rank 0 logged this step"
    )
    p.add_argument(
        "--mttr-fault",
        choices=("kill", "stop"),
        default="kill",
        help="MTTR: SIGKILL rank 1 (a crash), or SIGSTOP it (a hang, found by the watchdog)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=3.0,
        help="MTTR with --mttr-fault stop: parallel.hang_timeout_s",
    )
    p.add_argument("--codec-mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=9, help="codec: timed repetitions per row")
    p.add_argument(
        "--image-bytes",
        type=int,
        default=2_890_000,
        help="codec: also time the agent's path (CRC, encode) at one rank's snapshot image size",
    )
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the pieces of each snapshot and save in the workers (generated sitecustomize.py)",
    )
    p.add_argument("--job-timeout", type=float, default=300, help="seconds a job may take")
    p.add_argument("--keep", action="store_true", help="keep the jobs' directories (logs, metrics)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.mttr_starts = [x for x in args.mttr_starts.split(",") if x]
    if not args.mttr_starts or set(args.mttr_starts) - {"fresh", "forkserver"}:
        p.error("--mttr-starts: a comma-separated list of fresh, forkserver")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.nodes < 1 or args.nproc < 1:
        p.error("--nodes and --nproc must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    marker = uuid.uuid4().hex
    root = Path(tempfile.mkdtemp(prefix="strata-snapbench-"))
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below still cleans up
    world = args.nodes * args.nproc
    print(
        f"snapshot overhead: tiny.yaml, {args.nodes} node(s) x {args.nproc} ranks (world {world}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, numpy {np.__version__}; load {os.getloadavg()}; "
        f"scratch {root}",
        flush=True,
    )
    ensure_default_corpus(None, 0.05)  # prepared once here, not raced by 4 workers
    result: dict = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    }
    try:
        if "codec" in args.parts:
            print(
                f"\n[codec] {args.codec_mib} MiB, best/median of {args.reps}, GB/s of image bytes",
                flush=True,
            )
            result["codec"] = codec_bench(args.codec_mib, args.reps, args.image_bytes)
        if "pieces" in args.parts:
            print(
                "\n[pieces] one rank's snapshot work, quiet, in this process (1 thread)", flush=True
            )
            result["pieces"] = pieces_bench(args, root)
        runs = []
        order = schedule(args) if {"stall", "disk"} & set(args.parts) else []
        if order:
            print(
                f"\n[steps] jobs in this order: {', '.join(order)}; {args.steps} steps each",
                flush=True,
            )
        seen: dict[str, int] = {}
        for variant in order:
            seen[variant] = seen.get(variant, 0) + 1
            runs.append(run_variant(args, marker, root, variant, seen[variant]))
        result["runs"] = [{k: v for k, v in r.items() if k != "timings"} for r in runs]
        if "mttr" in args.parts:
            print("\n[mttr]", flush=True)
            result["mttr"] = mttr(args, marker, root)
    finally:
        kill(processes(marker))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if runs:
        report_steps(args, runs, result)
    if "codec" in result:
        print(
            "\n[codec] "
            + ", ".join(f"{r['what']}: {r['best_gbps']:.2f}" for r in result["codec"])
            + " GB/s (best)"
        )
    if "mttr" in result:
        report_mttr(result["mttr"])
    verdicts(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.keep:
        print(f"kept {root}")
    return 0


def report_steps(args, runs: list[dict], result: dict) -> None:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    step = {v: median([r["step_s"] for r in rs]) for v, rs in by.items()}
    s = result["steps"] = {
        "step_ms": {v: 1e3 * t for v, t in step.items()},
        "step_ms_runs": {v: [1e3 * r["step_s"] for r in rs] for v, rs in by.items()},
    }
    per_step = args.log_interval * args.skip_intervals
    bd = s["breakdown"] = (
        {v: breakdown_of(rs, per_step) for v, rs in by.items()} if args.breakdown else {}
    )
    roles = [
        r
        for r in ("worker", "agent", "writer", "torchrun", "launcher", "store", "other")
        if any(r in run["cpu_ms_per_step"] for run in runs)
    ]
    cpu = s["cpu_ms_per_step"] = {
        v: {role: median([r["cpu_ms_per_step"].get(role, 0.0) for r in rs]) for role in roles}
        for v, rs in by.items()
    }
    print(
        f"\n[steps] per variant: median over runs of each run's median step time (log intervals "
        f"{per_step + args.log_interval}..{args.steps}); train_step = the compute alone (every rank); CPU ms a step "
        "summed over the job's processes of each role (between two records)"
    )
    table(
        [
            [
                v,
                fmt(1e3 * step[v], ".1f"),
                ", ".join(f"{1e3 * r['step_s']:.1f}" for r in by[v]),
                fmt(step[v] / step["off"], ".3f") if "off" in step else "n/a",
                fmt(bd.get(v, {}).get("train_step", {}).get("median_ms"), ".1f"),
                fmt(bd.get(v, {}).get("train_step (cpu)", {}).get("median_ms"), ".1f"),
                *[fmt(cpu[v][role], ".1f") for role in roles],
                fmt(sum(cpu[v].values()), ".1f"),
            ]
            for v in by
        ],
        [
            "variant",
            "step ms",
            "runs (ms)",
            "vs off",
            "train_step ms",
            "its cpu ms",
            *[f"cpu {r}" for r in roles],
            "cpu total",
        ],
    )
    if "snap" in by:
        stall = median([r["stall_ms"] for r in by["snap"]])
        full = bd.get("snap", {}).get("trainer_snapshot", {}).get("rank0_median_ms")
        s.update(
            snapshot_stall_ms=stall,
            snapshot_stall_ms_runs=[r["stall_ms"] for r in by["snap"]],
            stall_over_step=stall / (1e3 * step["snap"]),
            snapshot_call_ms=full,
            call_over_step=full / (1e3 * step["snap"]) if full else None,
            snap_over_off=step["snap"] / step["off"] if "off" in step else None,
            snap_cost_ms=1e3 * (step["snap"] - step["off"]) if "off" in step else None,
            skipped=[r["skipped"] for r in by["snap"]],
            agents=[a for r in by["snap"] for a in r["agents"]],
        )
        print(
            f"\n  snapshot stall, rank 0's metrics (SnapshotManager.save): median {stall:.2f} ms (runs "
            f"{', '.join(fmt(r['stall_ms']) for r in by['snap'])}) = {100 * s['stall_over_step']:.1f} % of the "
            f"{1e3 * step['snap']:.1f} ms step; snapshots skipped {s['skipped']}"
        )
        if full is not None:
            print(
                "  the whole Trainer.snapshot call, rank 0: "
                f"{full:.2f} ms "
                f"= {100 * s['call_over_step']:.1f} % of the step"
            )
        if s["snap_over_off"] is not None:
            print(
                f"  step time snap/off: {s['snap_over_off']:.3f} ({s['snap_cost_ms']:+.1f} ms a step)"
            )
        for a in s["agents"]:
            print(f"  agent stats: {a}")
        if "snap" in bd:
            print(
                "\n  snapshot pieces, per call, ms (every rank's calls; the first interval dropped)"
            )
            names = [
                "trainer_snapshot",
                "trainer_snapshot (cpu)",
                "state_to_save",
                "save",
                "settle",
                "rpc_lease",
                "stage",
                "all_reduce_async",
                "all_reduce",
                "background_finish",
                "rpc_commit",
            ]
            table(
                [
                    [
                        n,
                        fmt(bd["snap"][n]["median_ms"], ".3f"),
                        fmt(bd["snap"][n]["p95_ms"], ".3f"),
                        fmt(bd["snap"][n]["worst_rank_median_ms"], ".3f"),
                        fmt(bd["snap"][n]["rank0_median_ms"], ".3f"),
                        bd["snap"][n]["calls"],
                    ]
                    for n in names
                    if n in bd["snap"]
                ],
                ["piece", "median", "p95", "worst rank's median", "rank 0's median", "calls"],
            )
    ckpt_names = [
        "trainer_save",
        "trainer_save (cpu)",
        "state_to_save",
        "ckpt_save",
        "ckpt_wait",
        "ckpt_stage",
        "ckpt_poll",
    ]
    if any("trainer_save" in bd.get(v, {}) for v in ("sync", "async")):
        print(
            "\n  disk checkpoint pieces, per call, ms (median over every rank's calls / rank 0's median); ckpt_wait: "
            "waiting for the previous save inside save; ckpt_poll: the per-step status all-reduce, in train_step"
        )
        table(
            [
                [
                    n,
                    *[
                        f"{fmt(bd[v][n]['median_ms'], '.2f')} / {fmt(bd[v][n]['rank0_median_ms'], '.2f')}"
                        if n in bd.get(v, {})
                        else ""
                        for v in ("sync", "async")
                    ],
                ]
                for n in ckpt_names
            ],
            ["piece", "sync", "async"],
        )
    for v in ("sync", "async"):
        if v in by and "off" in step:
            s[f"{v}_cost_ms"] = 1e3 * (step[v] - step["off"])
        if "trainer_save" in bd.get(v, {}):
            s[f"{v}_save_ms"] = bd[v]["trainer_save"]["rank0_median_ms"]
    if "snap" in by and any(v in by for v in ("sync", "async")):
        rows = [
            [
                "snapshot (every step)",
                fmt(s["snap_cost_ms"], ".1f"),
                fmt(s["snapshot_call_ms"], ".2f"),
                "1.0",
                "1.0",
            ]
        ]
        for v in ("sync", "async"):
            if v not in by:
                continue
            direct, cost = s.get(f"{v}_save_ms"), s.get(f"{v}_cost_ms")
            s[f"{v}_over_snapshot"] = (
                direct / s["snapshot_call_ms"] if direct and s["snapshot_call_ms"] else None
            )
            s[f"{v}_over_snapshot_steptime"] = (
                cost / s["snap_cost_ms"]
                if cost is not None and s["snap_cost_ms"] and s["snap_cost_ms"] > 0
                else None
            )  # n/a: lost in the noise
            rows.append(
                [
                    f"{v} checkpoint (every step)",
                    fmt(cost, ".1f"),
                    fmt(direct, ".2f"),
                    fmt(s[f"{v}_over_snapshot"], ".1f"),
                    fmt(s[f"{v}_over_snapshot_steptime"], ".1f"),
                ]
            )
        print(
            "\n  against disk checkpoints of the same state (ms a step; stall = the Trainer.snapshot / Trainer.save "
            "call, rank 0's median)"
        )
        table(
            rows,
            ["save", "step time - off", "stall", "stall / snapshot's", "(step - off) / snapshot's"],
        )


def report_mttr(m: dict) -> None:
    by, starts = m["by_start"], list(m["by_start"])
    runs = {start: [r for r in m["runs"] if r["worker_start"] == start] for start in starts}
    print(
        f"\n[mttr] {m['fault']} of RANK=1 once rank 0 logged step {m['runs'][0]['step_at_kill']}; seconds from the "
        f"signal, median of {len(runs[starts[0]])} job(s) per `strata launch --worker-start`:"
    )
    rows = [
        ["first torchrun message", "first_message_s"],
        ["old workers all gone (exited, on both nodes)", "old_workers_gone_s"],
        ["first restarted worker process", "first_restart_process_s"],
        ["last restarted worker process", "last_restart_process_s"],
        ["imports and config done, runtime.start called (last rank)", "imports_done_s"],
        ["init_process_group done (last rank)", "process_group_s"],
        ["Trainer built (last rank)", "trainer_built_s"],
        ["restored ('resumed' record)", "resumed_s"],
        ["first step logged", "first_step_s"],
        ["trainer restore_s (inside)", "restore_s"],
    ]
    if m["hang_timeout_s"] is not None:
        rows.insert(
            0,
            [
                f"hang verdict printed (parallel.hang_timeout_s={m['hang_timeout_s']:g})",
                "verdict_s",
            ],
        )
    table(
        [[label, *[fmt(by[start][key]) for start in starts]] for label, key in rows],
        ["event", *starts],
    )
    for start in starts:
        for r in runs[start]:
            print(
                f"  {start}: first step {fmt(r['first_step_s'])} s (step {r['first_step']}), resumed at step "
                f"{r['resumed_step']}: {r['resumed']}; {r['restarted_workers']} workers restarted, {r['forked']} of "
                f"them forked; exit codes {r['exit_codes']}; load {r['load_after']:.2f} after"
            )


def verdicts(result: dict) -> None:
    print("\nverdicts:")
    s = result.get("steps", {})
    if "stall_over_step" in s:
        worst = max(x for x in (s["stall_over_step"], s.get("call_over_step")) if x is not None)
        print(
            f"  snapshot stall / step = {100 * s['stall_over_step']:.1f} % (metrics' stall_ms), "
            f"{fmt(100 * s['call_over_step'] if s.get('call_over_step') else None, '.1f')} % (whole Trainer.snapshot)"
            f" (goal < {100 * STALL_GOAL:.0f} %): {'met' if worst < STALL_GOAL else 'NOT met'}; whole step time "
            f"snap/off = {fmt(s.get('snap_over_off'), '.3f')} "
            f"({'within' if (s.get('snap_over_off') or 9) < 1 + STALL_GOAL else 'NOT within'} 5 %)"
        )
    for v in ("sync", "async"):
        if s.get(f"{v}_over_snapshot") is not None:
            print(
                f"  {v} checkpoint stall / snapshot stall = {s[f'{v}_over_snapshot']:.1f}x (timed calls; "
                "by step time "
                f"minus off: {fmt(s.get(f'{v}_over_snapshot_steptime'), '.1f')}x); the paper's > "
                f"{PAPER_SAVE_RATIO:.0f}x is faster saving than async checkpointing measured as time to durable"
            )
    if "codec" in result:
        c = {r["what"]: r["best_gbps"] for r in result["codec"]}
        print(
            f"  Code(1,1) encode {fmt(c.get('Code(1,1) encode'))} GB/s, Code(4,2) encode "
            f"{fmt(c.get('Code(4,2) encode'))} / decode {fmt(c.get('Code(4,2) decode (lose 2)'))} GB/s, against "
            f"numpy.copyto {fmt(c.get('numpy.copyto'))} GB/s (best of the runs)"
        )
    if "mttr" in result:
        m = result["mttr"]
        by = m["by_start"]
        for start, runs in ((st, [r for r in m["runs"] if r["worker_start"] == st]) for st in by):
            ok = all(r["in_memory"] and all(c == 0 for c in r["exit_codes"].values()) for r in runs)
            met = "met" if (by[start]["first_step_s"] or 1e9) <= MTTR_GOAL_S else "NOT met"
            print(
                f"  MTTR ({start} workers) {fmt(by[start]['first_step_s'])} s from the kill to the first step "
                f"({fmt(by[start]['resumed_s'])} s to restored; the restore itself {fmt(by[start]['restore_s'])} s) "
                f"(goal <= {MTTR_GOAL_S:g} s: {met}): "
                f"{'resumed from memory, every node exit 0' if ok else 'FAILED: ' + str(runs)}"
            )
        if (
            {"fresh", "forkserver"} <= set(by)
            and by["fresh"]["first_step_s"]
            and by["forkserver"]["first_step_s"]
        ):
            print(
                f"  forkserver / fresh MTTR = {by['forkserver']['first_step_s'] / by['fresh']['first_step_s']:.2f} "
                "(same run)"
            )


if __name__ == "__main__":
    sys.exit(main())
