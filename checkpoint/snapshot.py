"""A worker's side of in-memory snapshots: stage this rank's state, as the image of its checkpoint
file, into a memory slot its node's snapshot agent (`launch.snapshot_agent`) owns; and, after a
restart, find the newest step every rank can restore from the agents and open it as a checkpoint.

Every call is collective over the world, so all ranks snapshot the same steps and restore the same one.

Losing the agent (it crashed, or was killed; `strata launch` restarts it on the same socket) never
stops training: the snapshot that finds the connection broken is skipped with a warning, and the
next one reconnects every rank whose connection broke, tells every agent the new one's address, and
snapshots resume into the new agent, which starts empty.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.checkpoint.agent_protocol import SOCKET_ENV, connect, request
from strata.checkpoint.pieces import Piece, SavableState
from strata.checkpoint.reader import Checkpoint
from strata.checkpoint.stage import (
    OBJECTS_FILE,
    Staging,
    copy_pieces,
    descriptors,
    index_of,
    objects_blob,
    plan_staging,
    write_templates,
)
from strata.checkpoint.store import data_file
from strata.config import SnapshotConfig, snapshot_nodes_problem
from strata.errors import StrataError
from strata.parallel import comm

START_PATIENCE_S = 10.0  # how long a starting worker waits for an agent that is (re)starting


@dataclass
class _Mapped:
    """A slot of the agent mapped into this process."""

    map: mmap.mmap
    tensor: torch.Tensor
    plan: int = -1  # the staging plan whose templates the slot holds


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
                f"snapshot.every_steps={cfg.every_steps} needs the node's snapshot agent, which `strata "
                f"launch` starts; set {SOCKET_ENV} if you start torchrun yourself, or set "
                "snapshot.every_steps=0"
            )
        self.path = path
        try:
            self.sock, self.hello = self._connect(patience=min(cfg.agent_timeout_s, START_PATIENCE_S))
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
        self.broken: str | None = None  # why this rank's connection to its agent broke, until it is back
        self._staging: Staging | None = None
        self._plan = 0
        self._index_json: str | None = None
        self._slots: dict[int, _Mapped] = {}
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
        self.nodes = list(dict.fromkeys(self.agent_of_rank))  # node order: by the lowest rank on each
        msg = {"op": "peers", "agents": sorted(set(every)), "nodes": self.nodes, "k": self.cfg.k, "m": self.cfg.m}
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
            print(f"strata: rank {self.rank}: reconnected to the snapshot agent at step {step}", flush=True)
        self.broken = None
        self.reconnects += 1
        return True

    # --- saving ------------------------------------------------------------------------------
    def save(self, step: int, state: SavableState) -> bool:
        """Snapshot this rank's `state` as step `step` (collective). Returns False when it was skipped
        because some rank's agent was still placing the previous one (or is unreachable)."""
        start = time.perf_counter()
        contents = state.contents(step)
        pieces = contents.pieces
        staging, lease, trailer = self._plan_and_lease(
            step, pieces, contents.objects, contents.aliases, contents.layout
        )
        if staging is None or lease is None:
            self.skipped += 1
            return False
        nbytes = staging.nbytes + len(trailer)
        slot = self._slots[lease]
        if slot.plan != self._plan:
            write_templates(slot.tensor, staging.items)
            slot.plan = self._plan
        copy_pieces(slot.tensor, staging.items, pieces)
        slot.map[staging.nbytes : nbytes] = trailer
        meta = {
            "rank": self.rank,
            "step": step,
            "world": self.world,
            "nbytes": nbytes,
            "data": staging.nbytes,
            "trailer": len(trailer),
            "saved_at": time.time(),  # tells two images of one step apart (a run rolled back and replayed it)
        }
        try:
            reply, _ = request(self.sock, {"op": "commit", "slot": lease, "meta": meta})
        except OSError as e:  # the agent died with the image: this step's snapshot is incomplete
            self._lost(step, e)
            self.skipped += 1
            return False
        if not reply["ok"]:
            raise StrataError(f"the snapshot agent refused step {step}: {reply['error']}")
        self.stalls.append(time.perf_counter() - start)
        return True

    def _plan_and_lease(
        self, step: int, pieces: list[Piece], objects: dict, aliases: dict, layout: dict
    ) -> tuple[Staging | None, int | None, bytes]:
        """The staging plan, a leased slot (None: every rank skips this snapshot, because some
        rank's agent is still placing the previous one, or some rank lost its agent) and the slot's
        trailer. Usually one all-reduce of [plan unchanged here, slot leased here, agent reachable
        here] (MIN over ranks); a first snapshot, or pieces that changed on some rank, cost a second
        round; a lost agent, the reconnection's rounds instead of this snapshot."""
        descs = descriptors(pieces)
        same = self._staging is not None and self._staging.descs[self.rank] == descs
        lease_now = same and self.broken is None
        trailer, lease = self._lease_for(step, objects, aliases, layout) if lease_now else (b"", None)
        agreed = torch.tensor([int(same), int(lease is not None), int(self.broken is None)])
        comm.all_reduce(agreed, self.group, dim="checkpoint", op=dist.ReduceOp.MIN)
        if not agreed[2]:  # some rank lost its agent: every rank takes part in reconnecting instead
            self._release(lease, step)
            self._reconnect(step)
            return self._staging, None, b""
        if not agreed[0]:  # plan again from every rank's pieces
            self._release(lease, step)
            self._staging = plan_staging(comm.all_gather_objects(descs, self.group), self.rank)
            self._plan, self._index_json = self._plan + 1, None
            trailer, lease = self._lease_for(step, objects, aliases, layout)
            agreed[1] = comm.all_true(lease is not None, self.group, dim="checkpoint")
        if not agreed[1]:
            self._release(lease, step)
            lease = None
        assert self._staging is not None  # kept (the plan is the same) or planned just now
        return self._staging, lease, trailer

    def _lease_for(self, step: int, objects: dict, aliases: dict, layout: dict) -> tuple[bytes, int | None]:
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

    def _trailer(self, step: int, staging: Staging, objects: dict, aliases: dict, layout: dict) -> bytes:
        """What follows the file image in a rank's slot: on rank 0 the objects file and the index
        (so both are protected like the data), elsewhere nothing."""
        if self.rank != 0:
            return b""
        blob, where = objects_blob(objects)
        if self._index_json is None:  # the tensors' chunks, by far the largest part, change with the plan only
            fixed = {
                k: v for k, v in index_of(step, layout, staging, {}, aliases).items() if k not in ("step", "objects")
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
            self._slots[reply["slot"]] = _Mapped(mapped, torch.frombuffer(mapped, dtype=torch.uint8))
        return reply["slot"]

    def stats(self) -> dict:
        """Stall per snapshot (ms) since the last call (None: no snapshot was taken), snapshots
        skipped so far, and reconnections to a restarted agent so far."""
        stalls, self.stalls = self.stalls, []
        return {
            "stall_ms": 1e3 * sum(stalls) / len(stalls) if stalls else None,
            "skipped": self.skipped,
            "reconnects": self.reconnects,
        }

    # --- restoring ---------------------------------------------------------------------------
    def recover(self) -> Recovery:
        """The newest step every rank of the saving world can restore (collective): each agent's
        holdings are gathered, the step chosen, and the images assembled by this rank's agent."""
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        try:
            holdings, _ = request(self.sock, {"op": "holdings"})
        except OSError as e:  # the agent died just now: it holds nothing, and the next snapshot reconnects
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
                {"op": "fetch", "step": step, "ranks": ranks, "sources": {str(r): sources[step][r] for r in ranks}},
            )
        except OSError as e:
            self._lost(None, e)
            reply, fds = {"ok": False, "error": f"rank {self.rank} lost its snapshot agent ({e})"}, []
        ok = comm.all_true(reply["ok"], self.group, dim="checkpoint")
        if not ok:
            for fd in fds:
                os.close(fd)
            failures = [e for e in comm.all_gather_objects(reply.get("error"), self.group) if e]
            return Recovery(None, f"step {step} could not be assembled ({failures[0]})", True)
        images = dict(zip(ranks, fds))
        metas = {r: reply["metas"][str(r)] for r in ranks}
        how = {r: reply["how"][str(r)] for r in ranks}
        return Recovery(_open(step, images, metas), f"in-memory step {step} ({_describe(how)})", True)

    def close(self) -> None:
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
        best = max(found.values(), key=lambda e: (bool(e["full"]), e["meta"].get("saved_at", 0.0), len(e["frags"])))
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
    return f"{ranks[0]}–{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))
