"""A worker's side of in-memory snapshots: stage this rank's state, as the image of its checkpoint
file, into a memory slot its node's snapshot agent (`launch.snapshot_agent`) owns; and, after a
restart, find the newest step every rank can restore from the agents and open it as a checkpoint.

Every call is collective over the world, so all ranks snapshot the same steps and restore the same one.

Losing the agent (it crashed, or was killed; `strata launch` restarts it on the same socket) never
stops training: the snapshot that finds the connection broken is skipped with a warning, and the
next one reconnects every rank whose connection broke, tells every agent the new one's address, and
snapshots resume into the new agent, which starts empty.

What a snapshot stalls the step for is the copy into the leased slot and little else: the pieces and
the copy's views are made once per plan (`checkpoint.pieces.CachedPieces`, `checkpoint.stage.Sources`),
and the ranks' agreement to commit (every rank's plan unchanged, slot leased, agent reachable) is an
all-reduce started as the call returns. A background thread waits for it, which costs nothing since
every rank reaches it within the step, and then commits the slot to the agent or releases it; the
next snapshot (or `close`, or `recover`) first waits for that thread, so the ranks still commit the
same steps, and act together on what the agreement said (plan again, or reconnect).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from strata.checkpoint.agent_protocol import SOCKET_ENV, connect, request
from strata.checkpoint.pieces import SavableState
from strata.checkpoint.reader import Checkpoint
from strata.checkpoint.stage import (
    OBJECTS_FILE,
    Staging,
    index_of,
    objects_blob,
    prepare_image,
    replan,
    stage,
)
from strata.checkpoint.store import data_file
from strata.config.schema import SnapshotConfig
from strata.config.vocabulary import snapshot_nodes_problem
from strata.errors import StrataError
from strata.parallel import comm

START_PATIENCE_S = 10.0  # how long a starting worker waits for an agent that is (re)starting


@dataclass
class _Mapped:
    """A slot of the agent mapped into this process."""

    map: mmap.mmap
    tensor: torch.Tensor
    plan: int = -1  # the staging plan whose templates (and `views`) the slot holds
    # the slot's view for each item of that plan
    views: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Pending:
    """A snapshot copied into its slot, waiting for every rank's agreement to be committed."""

    step: int
    # [plan unchanged, slot leased, agent reachable]: MIN over the ranks once `work` is done
    flags: torch.Tensor
    work: comm.AsyncWork
    lease: int | None
    meta: dict
    stall: float  # seconds the save call took
    agreed: tuple[int, ...] = ()  # the flags every rank agreed on (set by the committer)
    error: BaseException | None = None  # raised by the next call that settles it


class _Committer:
    """One daemon thread that finishes each snapshot in the background (`SnapshotManager._finish`)."""

    def __init__(self, finish):
        self._finish = finish
        self._jobs: queue.Queue[_Pending] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name="strata-snapshot-commit", daemon=True).start()

    def submit(self, pending: _Pending) -> None:
        """Queue `pending` for the thread to finish."""
        self._idle.clear()
        self._jobs.put(pending)

    def wait(self) -> None:
        """Block until the snapshot submitted last is finished (the manager has one in flight at a
        time)."""
        self._idle.wait()

    def _run(self) -> None:
        while True:
            pending = self._jobs.get()
            try:
                self._finish(pending)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
                pending.error = e
            finally:
                self._idle.set()


@dataclass
class Recovery:
    """What `SnapshotManager.recover` found: the checkpoint to resume from (None: nothing every rank
    can restore) and a sentence saying what happened."""

    checkpoint: Checkpoint | None
    message: str
    restarted: bool


class AgentUnreachable(StrataError):
    """Some rank cannot reach its node's snapshot agent (raised on every rank alike): the launcher
    gave up restarting it, or it was never started (torchrun run by hand with a stale socket)."""


class SnapshotManager:
    """Snapshots of this rank through the node's agent (collective calls over `group`)."""

    def __init__(self, cfg: SnapshotConfig, rank: int, world: int, group, env=os.environ):
        self.cfg, self.rank, self.world, self.group = cfg, rank, world, group
        path = env.get(SOCKET_ENV)
        if not path:
            raise StrataError(
                f"snapshot.every_steps={cfg.every_steps} needs the node's snapshot agent, which "
                f"`strata launch` starts; set {SOCKET_ENV} if you start torchrun yourself, or set "
                "snapshot.every_steps=0"
            )
        self.path = path
        try:
            self.sock, self.hello = self._connect(
                patience=min(cfg.agent_timeout_s, START_PATIENCE_S)
            )
            unreachable = ""
        except OSError as e:
            unreachable = f"cannot reach the snapshot agent at {path} ({e})"
        # Every rank takes snapshots or none does (they are collective): agree before going on.
        if not comm.all_true(not unreachable, group, dim="snapshot"):
            if not unreachable:
                self.sock.close()
            raise AgentUnreachable(
                unreachable or "another node cannot reach its snapshot agent",
            )
        # why this rank's connection to its agent broke, until it is back
        self.broken: str | None = None
        self._staging: Staging | None = None
        self._plan = 0
        self._replan_due = False  # some rank's pieces changed: plan again at the next snapshot
        self._index_json: str | None = None
        self._slots: dict[int, _Mapped] = {}
        self._pending: _Pending | None = None
        self._committer = _Committer(self._finish)
        self._counts = threading.Lock()  # stalls and skipped: the committer adds to them
        self.stalls: list[float] = []
        self.skipped = 0
        self.reconnects = 0  # times the ranks reconnected to a restarted agent
        every = comm.all_gather_objects(self.hello, group)
        self._introduce(every)
        problem = snapshot_nodes_problem(cfg, len(self.nodes))
        if problem:
            raise StrataError(problem)

    def _connect(self, patience: float) -> tuple[socket.socket, tuple[str, str, int]]:
        """A connection to the node's agent and its (id, host, port); an agent still starting (no
        socket yet, or not listening) is waited for up to `patience` seconds."""
        deadline = time.monotonic() + patience
        while True:
            try:
                sock = connect(self.path, self.cfg.agent_timeout_s)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
                continue
            try:
                hello, _ = request(sock, {"op": "hello", "rank": self.rank})
            except OSError:
                sock.close()
                raise
            return sock, (hello["agent"], hello["host"], hello["port"])

    def _introduce(self, every: list[tuple[str, str, int]]) -> None:
        """Tell this rank's agent every rank's agent (gathered: `every`), the node order and the code."""
        self.agent_of_rank = [a for a, _, _ in every]
        # node order: by the lowest rank on each
        self.nodes = list(dict.fromkeys(self.agent_of_rank))
        msg = {
            "op": "peers",
            "agents": sorted(set(every)),
            "nodes": self.nodes,
            "k": self.cfg.k,
            "m": self.cfg.m,
        }
        request(self.sock, msg)

    def _lost(self, step: int | None, error: OSError) -> None:
        """This rank's connection to its agent broke: say so once, and reconnect at the next snapshot."""
        if self.broken is None:
            when = "" if step is None else f" at step {step}"
            print(
                f"strata: warning: rank {self.rank}: lost the snapshot agent{when} ({error}); "
                "snapshots are skipped until it is back (training continues)",
                flush=True,
            )
        self.broken = f"{type(error).__name__}: {error}"

    def _reconnect(self, step: int) -> bool:
        """Collective, when some rank's connection broke: each such rank connects to its agent again
        (restarted by `strata launch`, with a new id and port), and every rank tells its agent the
        new map. True once every rank is connected again; else the next snapshot tries again."""
        mine: tuple[str, str, int] | None = self.hello
        if self.broken is not None:
            self._slots.clear()  # the dead agent's slots; the new one hands out its own
            with contextlib.suppress(OSError):
                self.sock.close()
            try:
                self.sock, self.hello = self._connect(patience=0)
                mine = self.hello
            except OSError:
                mine = None  # not back yet (or gone for good: then snapshots stay off)
        every = comm.all_gather_objects((mine, self.broken is not None), self.group)
        if any(hello is None for hello, _ in every):
            return False
        introduced = True
        try:
            self._introduce([hello for hello, _ in every])
        except OSError as e:
            self._lost(step, e)
            introduced = False
        if not comm.all_true(introduced, self.group, dim="checkpoint"):
            return False
        if self.broken is not None:
            print(
                f"strata: rank {self.rank}: reconnected to the snapshot agent at step {step}",
                flush=True,
            )
        self.broken = None
        self.reconnects += 1
        return True

    # --- saving ------------------------------------------------------------------------------
    def save(self, step: int, state: SavableState) -> bool:
        """Snapshot this rank's `state` as step `step` (collective): copied into a leased slot now,
        committed in the background once every rank agrees. Returns False when this rank already
        knows the snapshot is skipped (its agent is placing the previous one, or is unreachable,
        or the ranks are reconnecting); True means it is committed unless another rank skips it."""
        start = time.perf_counter()
        previous = self._settle()
        if previous is not None and not previous.agreed[2] and not self._reconnect(step):
            self._skip()  # some rank lost its agent, and it is not back yet
            return False
        contents = state.contents(step)
        pieces = contents.pieces
        # every rank knows: the first snapshot, or agreed
        if self._staging is None or self._replan_due:
            self._staging = replan(pieces, self.rank, self.group)
            self._plan, self._index_json, self._replan_due = self._plan + 1, None, False
            same = True
        else:
            same = self._staging.sources.take(pieces)
        staging = self._staging
        lease, trailer = (None, b"")
        if same and self.broken is None:
            trailer, lease = self._lease_for(
                step, contents.objects, contents.aliases, contents.layout
            )
        nbytes = staging.nbytes + len(trailer)
        if lease is not None:
            slot = self._slots[lease]
            if slot.plan != self._plan:
                slot.plan, slot.views = self._plan, prepare_image(slot.tensor, staging.items)
            stage(slot.views, staging.sources)
            slot.map[staging.nbytes : nbytes] = trailer
        flags = torch.tensor([int(same), int(lease is not None), int(self.broken is None)])
        work = comm.all_reduce_async(flags, self.group, dim="checkpoint", op=dist.ReduceOp.MIN)
        meta = {
            "rank": self.rank,
            "step": step,
            "world": self.world,
            "nbytes": nbytes,
            "data": staging.nbytes,
            "trailer": len(trailer),
            "saved_at": time.time(),  # tells two images of one step apart (a run rolled back and replayed it)
        }
        self._pending = _Pending(step, flags, work, lease, meta, time.perf_counter() - start)
        self._committer.submit(self._pending)
        return lease is not None

    def _finish(self, pending: _Pending) -> None:
        """The committer thread: wait for the ranks' agreement, then commit the slot (every rank
        leased one, with the same plan, and reaches its agent) or release it."""
        pending.work.wait()
        pending.agreed = tuple(int(x) for x in pending.flags.tolist())
        if not all(pending.agreed):
            self._release(pending.lease, pending.step)
            self._skip()
            return
        try:
            reply, _ = request(
                self.sock, {"op": "commit", "slot": pending.lease, "meta": pending.meta}
            )
        except OSError as e:  # the agent died with the image: this step's snapshot is incomplete
            self._lost(pending.step, e)
            self._skip()
            return
        if not reply["ok"]:
            raise StrataError(f"the snapshot agent refused step {pending.step}: {reply['error']}")
        with self._counts:
            self.stalls.append(pending.stall)

    def _settle(self) -> _Pending | None:
        """Wait until the snapshot in flight is committed or released (normally long done); raise
        what went wrong there; note what the ranks agreed on."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self._committer.wait()
        if pending.error is not None:
            raise pending.error
        if not pending.agreed[0]:
            self._replan_due = True
        return pending

    def _skip(self) -> None:
        with self._counts:
            self.skipped += 1

    def _lease_for(
        self, step: int, objects: dict, aliases: dict, layout: dict
    ) -> tuple[bytes, int | None]:
        staging = self._staging
        assert staging is not None  # called with a plan in place
        trailer = self._trailer(step, staging, objects, aliases, layout)
        return trailer, self._lease(staging.nbytes + len(trailer), step)

    def _release(self, lease: int | None, step: int) -> None:
        if lease is not None and self.broken is None:
            try:
                request(self.sock, {"op": "release", "slot": lease})
            except OSError as e:
                self._lost(step, e)

    def _trailer(
        self, step: int, staging: Staging, objects: dict, aliases: dict, layout: dict
    ) -> bytes:
        """What follows the file image in a rank's slot: on rank 0 the objects file and the index
        (so both are protected like the data), elsewhere nothing."""
        if self.rank != 0:
            return b""
        blob, where = objects_blob(objects)
        # the tensors' chunks, by far the largest part, change with the plan only
        if self._index_json is None:
            fixed = {
                k: v
                for k, v in index_of(step, layout, staging, {}, aliases).items()
                if k not in ("step", "objects")
            }
            self._index_json = json.dumps(fixed)
        index = self._index_json[:-1] + f', "step": {step}, "objects": {json.dumps(where)}}}'
        return len(blob).to_bytes(8, "little") + blob + index.encode()

    def _lease(self, nbytes: int, step: int) -> int | None:
        if self.broken is not None:
            return None
        try:
            reply, fds = request(self.sock, {"op": "lease", "rank": self.rank, "nbytes": nbytes})
        except OSError as e:
            self._lost(step, e)
            return None
        if not reply["ok"]:
            return None
        if fds:
            mapped = mmap.mmap(fds[0], reply["size"], flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            os.close(fds[0])
            self._slots[reply["slot"]] = _Mapped(
                mapped, torch.frombuffer(mapped, dtype=torch.uint8)
            )
        return reply["slot"]

    def stats(self) -> dict:
        """Stall per snapshot (ms) committed since the last call (None: none was), snapshots
        skipped so far, and reconnections to a restarted agent so far."""
        with self._counts:
            stalls, self.stalls = self.stalls, []
            skipped = self.skipped
        return {
            "stall_ms": 1e3 * sum(stalls) / len(stalls) if stalls else None,
            "skipped": skipped,
            "reconnects": self.reconnects,
        }

    # --- restoring ---------------------------------------------------------------------------
    def recover(self) -> Recovery:
        """The newest step every rank of the saving world can restore (collective): each agent's
        holdings are gathered, the step chosen, and the images assembled by this rank's agent."""
        self._settle()
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        try:
            holdings, _ = request(self.sock, {"op": "holdings"})
        # the agent died just now: it holds nothing, and the next snapshot reconnects
        except OSError as e:
            self._lost(None, e)
            holdings = {"agent": f"lost by rank {self.rank}", "full": [], "frags": []}
        every = comm.all_gather_objects((restarted, holdings), self.group)
        restarted = any(r for r, _ in every)
        sources = _sources({h["agent"]: h for _, h in every})
        step, why = _newest_complete(sources)
        if step is None:
            return Recovery(None, why, restarted or bool(sources))
        ranks = sorted(sources[step])
        try:
            if self.broken is not None:
                raise ConnectionError(self.broken)
            reply, fds = request(
                self.sock,
                {
                    "op": "fetch",
                    "step": step,
                    "ranks": ranks,
                    "sources": {str(r): sources[step][r] for r in ranks},
                },
            )
        except OSError as e:
            self._lost(None, e)
            reply, fds = (
                {"ok": False, "error": f"rank {self.rank} lost its snapshot agent ({e})"},
                [],
            )
        ok = comm.all_true(reply["ok"], self.group, dim="checkpoint")
        if not ok:
            for fd in fds:
                os.close(fd)
            failures = [e for e in comm.all_gather_objects(reply.get("error"), self.group) if e]
            return Recovery(None, f"step {step} could not be assembled ({failures[0]})", True)
        images = dict(zip(ranks, fds))
        metas = {r: reply["metas"][str(r)] for r in ranks}
        how = {r: reply["how"][str(r)] for r in ranks}
        return Recovery(
            _open(step, images, metas), f"in-memory step {step} ({_describe(how)})", True
        )

    def close(self) -> None:
        """Commit the snapshot in flight, then disconnect."""
        try:
            self._settle()
        finally:
            self._slots.clear()
            try:
                self.sock.close()
            except OSError:
                pass


def _sources(holdings: dict[str, dict]) -> dict[int, dict[int, dict]]:
    """{step: {rank: {"meta", "full": [agent…], "frags": {j: agent}}}} over every agent's holdings.
    A whole image counts once it is checksummed (the agent does that as it places it).

    One version per rank and step: a step saved twice (a run rolled back and replayed it, and the
    replay's placement did not reach every node, or an agent restarted between them) can leave
    images and fragments of two versions, told apart by their checksum. Only one version's are ever
    combined: the one with a whole image (its home agent keeps only the newest), else the most
    recently saved, else the one with the most fragments."""
    versions: dict[tuple[int, int], dict[str, dict]] = {}
    for agent, h in holdings.items():
        for rank, step, meta in h["full"]:
            if "crc" in meta:
                entry = versions.setdefault((step, rank), {}).setdefault(
                    meta["crc"], {"meta": meta, "full": [], "frags": {}}
                )
                entry["full"].append(agent)
        for rank, step, j, meta in h["frags"]:
            entry = versions.setdefault((step, rank), {}).setdefault(
                meta.get("crc"), {"meta": meta, "full": [], "frags": {}}
            )
            entry["frags"][str(j)] = agent
    out: dict[int, dict[int, dict]] = {}
    for (step, rank), found in versions.items():
        best = max(
            found.values(),
            key=lambda e: (bool(e["full"]), e["meta"].get("saved_at", 0.0), len(e["frags"])),
        )
        out.setdefault(step, {})[rank] = best
    return out


def _newest_complete(sources: dict[int, dict[int, dict]]) -> tuple[int | None, str]:
    """The newest step at which every rank of the saving world has a whole image or k fragments on
    live agents, or (None, why not)."""
    why = "no snapshot in any agent's memory"
    for step in sorted(sources, reverse=True):
        ranks = sources[step]
        world = next(iter(ranks.values()))["meta"]["world"]
        short = []
        for r in range(world):
            e = ranks.get(r)
            if e is None:
                short.append(f"rank {r}: nothing")
                continue
            k = e["meta"]["k"]
            if not (e["full"] or len(e["frags"]) >= k):
                short.append(f"rank {r}: {len(e['frags'])} of k={k} fragments")
        if not short:
            return step, ""
        if why.startswith("no snapshot"):
            why = f"the newest, step {step}, is incomplete on live agents ({'; '.join(short[:4])})"
    return None, why


def _open(step: int, images: dict[int, int], metas: dict[int, dict]) -> Checkpoint:
    """The assembled images as a checkpoint: rank r's data file is the start of its image; rank 0's
    trailer holds the objects file and the index."""
    files = {data_file(r): (fd, 0, metas[r]["data"]) for r, fd in images.items()}
    fd0, data0 = images[0], metas[0]["data"]
    blob_len = int.from_bytes(os.pread(fd0, 8, data0), "little")
    files[OBJECTS_FILE] = (os.dup(fd0), data0 + 8, blob_len)
    index_at = data0 + 8 + blob_len
    index = json.loads(os.pread(fd0, metas[0]["nbytes"] - index_at, index_at))
    return Checkpoint.from_images(f"in-memory snapshot step {step}", step, index, files)


def _describe(how: dict[int, str]) -> str:
    """'ranks 0–1 local, ranks 2–3 rebuilt from fragments [1]' from {rank: how}."""
    groups: dict[str, list[int]] = {}
    for r, via in sorted(how.items()):
        groups.setdefault(via, []).append(r)
    return ", ".join(f"ranks {_span(rs)} {via}" for via, rs in groups.items())


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    return (
        f"{ranks[0]}–{ranks[-1]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1))
        else ",".join(map(str, ranks))
    )
