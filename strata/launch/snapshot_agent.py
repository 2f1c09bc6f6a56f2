"""The snapshot agent: one long-lived process per node, beside torchrun (not a child of the workers),
that keeps the newest in-memory snapshots of the node's ranks and erasure-coded fragments of the
other nodes' ranks, and rebuilds any rank's image for a restarted worker.

Workers reach it over a Unix socket (0600, in a 0700 directory, peer uid checked); snapshot images
live in memfd slots the agent owns, mapped by the workers, so a snapshot is one copy and one small
message. Agents reach each other over TCP authenticated with the job's secret (`checkpoint.channel`).
Imports no torch, so it starts in a fraction of a second. Run as `python -m strata.launch.snapshot_agent`.
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import cast

import crc32c

from strata.checkpoint.agent_protocol import recv_msg, send_msg
from strata.checkpoint.channel import Channel, ChannelError, secret_from_env
from strata.checkpoint.erasure import Code, self_test

KEEP = 2  # committed versions kept per rank (local images and fragments); see `Agent.commit`
SWITCH_INTERVAL_S = 5e-4  # the GIL's: see main()
FULL = -1  # fragment index meaning "the whole image"


# --- state ----------------------------------------------------------------------------------


@dataclass
class Slot:
    """A memfd a worker writes one snapshot image of its rank into."""

    id: int
    fd: int
    size: int
    map: mmap.mmap
    state: str = "free"  # free | writing | committed
    owner: object = None  # the connection holding it while writing
    rank: int = -1
    step: int = -1
    meta: dict = field(default_factory=dict)
    placed: threading.Event = field(default_factory=threading.Event)
    seq: int = 0  # commit order


def _memfd(size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("strata-snapshot", os.MFD_CLOEXEC)
    # pages exist before a worker's first copy (§3.1: 5–8× slower otherwise)
    os.posix_fallocate(fd, 0, size)
    return fd, mmap.mmap(fd, size)


def _capacity(nbytes: int, k: int) -> int:
    """A slot's size: room for the image grown a little (the trailer varies) and whole fragments."""
    grain = 4096 * k
    return -(-(nbytes + nbytes // 8 + 4096) // grain) * grain


class Agent:
    """A node's snapshot agent: the memfd slots its workers write images into, the committed
    images and other nodes' erasure-coded fragments it keeps, its peers, and the threads serving
    the workers' Unix socket and the peers' TCP listener."""

    def __init__(
        self,
        socket_path: str,
        advertise: str,
        bind: str,
        port: int,
        secret: bytes,
        parent: int | None,
    ):
        self.id = uuid.uuid4().hex[:12]
        self.secret, self.parent = secret, parent
        self.lock = threading.Lock()
        self.slots: dict[int, Slot] = {}
        # (rank, step, j) -> (bytes, meta)
        self.frags: dict[tuple[int, int, int], tuple[bytearray, dict]] = {}
        # (rank, step) -> fd, map, meta, how
        self.restored: dict[tuple[int, int], tuple[int, mmap.mmap, dict, str]] = {}
        self.agents: dict[str, tuple[str, int]] = {}  # agent id -> (host, port)
        self.nodes: list[str] = [self.id]  # agent ids in node order
        self.k, self.m = 1, 0
        self._next_slot, self._commits = 0, 0
        self._peers: dict[str, tuple[threading.Lock, Channel | None]] = {}
        self.encode_seconds, self.encoded_bytes = 0.0, 0
        self.placements: queue.Queue = queue.Queue()
        self.tcp = socket.create_server((bind, port))
        self.address = (advertise, self.tcp.getsockname()[1])
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.unix.bind(socket_path)
        finally:
            os.umask(old)
        self.unix.listen(64)

    # --- serving ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Start the threads that accept workers and peer agents, place fragments and watch the
        parent launcher; then serve until the process is killed."""
        for target in (
            self._accept_local,
            self._accept_peers,
            self._place_loop,
            self._watch_parent,
        ):
            threading.Thread(target=target, daemon=True).start()
        threading.Event().wait()

    def _watch_parent(self) -> None:
        """Exit when the launcher that started the agent is gone (it is not our parent's child)."""
        while self.parent is None or os.getppid() == self.parent:
            time.sleep(0.5)
        os._exit(0)

    def _accept_local(self) -> None:
        while True:
            conn, _ = self.unix.accept()
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():  # the 0600 file already keeps others out; this checks it held
                conn.close()
                continue
            threading.Thread(target=self._serve_worker, args=(conn,), daemon=True).start()

    def _serve_worker(self, conn: socket.socket) -> None:
        sent: set[int] = set()  # slots whose descriptor this connection already has
        try:
            while True:
                msg, fds = recv_msg(conn)
                if msg is None:
                    return
                for fd in fds:
                    os.close(fd)
                then = None
                try:
                    reply, out_fds, *after = getattr(self, "op_" + msg["op"])(msg, conn, sent)
                    then = after[0] if after else None
                except Exception as e:  # a bad request, a dead peer: the worker gets the reason
                    reply, out_fds = {"ok": False, "error": f"{type(e).__name__}: {e}"}, []
                send_msg(conn, reply, out_fds)
                for fd in out_fds if reply.get("close_fds") else ():
                    os.close(fd)
                # work the reply need not wait for (a worker may be waiting on it)
                if then is not None:
                    then()
        except OSError:
            return
        finally:
            with self.lock:  # a worker that died mid-copy leaves its slot to be reused
                for slot in self.slots.values():
                    if slot.state == "writing" and slot.owner is conn:
                        slot.state, slot.owner = "free", None
            conn.close()

    # --- worker operations: each returns (reply, descriptors to send) ----------------------------
    def op_hello(self, msg, conn, sent):
        """A worker's first message: this agent's id and the address its peers reach it at."""
        return {"ok": True, "agent": self.id, "host": self.address[0], "port": self.address[1]}, []

    def op_peers(self, msg, conn, sent):
        """The job's rank → agent map (identical from every worker) and the code."""
        with self.lock:
            self.agents.update({a: (h, p) for a, h, p in msg["agents"]})
            self.nodes = list(msg["nodes"])
            self.k, self.m = int(msg["k"]), int(msg["m"])
        return {"ok": True}, []

    def op_lease(self, msg, conn, sent):
        """A free slot of at least `nbytes` for the rank, or a refusal while the rank's previous
        snapshot is still being placed (the worker then skips this snapshot: back-pressure)."""
        rank, nbytes = int(msg["rank"]), int(msg["nbytes"])
        with self.lock:
            newest = self._committed(rank)[-1:] or [None]
            if newest[0] is not None and not newest[0].placed.is_set():
                return {
                    "ok": False,
                    "busy": True,
                    "error": f"step {newest[0].step} is still being placed",
                }, []
            keep = {id(s) for s in self._committed(rank)[-KEEP:]}
            # A slot keeps its rank: the worker wrote its blob headers there once and only rewrites
            # the data.
            free = [
                s
                for s in self.slots.values()
                if s.state == "free"
                and s.size >= nbytes
                and id(s) not in keep
                and s.rank in (rank, -1)
            ]
            slot = free[0] if free else None
            if slot is None:
                fd, mapped = _memfd(_capacity(nbytes, self.k))
                self._next_slot += 1
                slot = self.slots[self._next_slot] = Slot(
                    self._next_slot, fd, mapped.size(), mapped
                )
            slot.state, slot.owner, slot.rank = "writing", conn, rank
        fds = [] if slot.id in sent else [slot.fd]
        sent.add(slot.id)
        return {"ok": True, "slot": slot.id, "size": slot.size}, fds

    def op_release(self, msg, conn, sent):
        """Give back a slot the asking worker was writing but will not commit (a skipped
        snapshot)."""
        with self.lock:
            slot = self.slots[int(msg["slot"])]
            if slot.owner is conn and slot.state == "writing":
                slot.state, slot.owner = "free", None
        return {"ok": True}, []

    def op_commit(self, msg, conn, sent):
        """The worker has written step `step` of its rank into the slot: it becomes the rank's
        newest version; versions from a rolled-back future (step ≥ this one) and all but the newest
        KEEP are freed; placement on the other nodes starts in the background."""
        meta = dict(msg["meta"])
        with self.lock:
            slot = self.slots[int(msg["slot"])]
            if slot.owner is not conn or slot.state != "writing":
                raise RuntimeError(f"slot {slot.id} is not leased to this worker")
            for old in self._committed(slot.rank):
                if old.step >= meta["step"]:
                    old.state = "free"
            self._commits += 1
            slot.state, slot.owner, slot.step = "committed", None, meta["step"]
            slot.meta, slot.seq = meta, self._commits
            slot.placed.clear()
            for old in self._committed(slot.rank)[:-KEEP]:
                old.state = "free"
            # every worker has restored before it trains
            for fd, mapped, _, _ in self.restored.values():
                mapped.close()
                os.close(fd)
            self.restored.clear()
        # Placement starts once the reply is sent: woken first, the placing thread would hold the
        # GIL for up to a switch interval (5 ms) while the worker waits for this reply.
        return {"ok": True}, [], lambda: self.placements.put(slot)

    def op_holdings(self, msg, conn, sent):
        """What this agent can serve: whole images and fragments, with their metadata."""
        with self.lock:
            full = [
                [s.rank, s.step, dict(s.meta)]
                for s in self.slots.values()
                if s.state == "committed"
            ]
            frags = [[r, st, j, dict(meta)] for (r, st, j), (_, meta) in self.frags.items()]
        return {"ok": True, "agent": self.id, "full": full, "frags": frags}, []

    def op_stats(self, msg, conn, sent):
        """The encoding rate so far, bytes encoded, and the newest step every rank's snapshot has
        been placed up to (-1: none)."""
        with self.lock:
            newest: dict[int, int] = {}  # rank -> its newest placed step (-1: none placed yet)
            for slot in self.slots.values():
                if slot.state == "committed":
                    step = slot.step if slot.placed.is_set() else -1
                    newest[slot.rank] = max(newest.get(slot.rank, -1), step)
            return {
                "ok": True,
                "encode_gbps": self.encoded_bytes / max(self.encode_seconds, 1e-9) / 1e9,
                "encoded_bytes": self.encoded_bytes,
                "placed_step": min(newest.values(), default=-1),  # every rank's placed up to here
            }, []

    def op_fetch(self, msg, conn, sent):
        """Images of step `step` for `ranks`, each local, copied from a peer, or rebuilt from k
        fragments; `sources` (from the ranks' gathered holdings) says which agent has what."""
        step, out, how = int(msg["step"]), [], {}
        metas = {}
        for rank in msg["ranks"]:
            fd, meta, via = self._image(int(rank), step, msg["sources"][str(rank)])
            out.append(fd)
            metas[str(rank)], how[str(rank)] = meta, via
        return {"ok": True, "metas": metas, "how": how, "close_fds": True}, out

    # --- assembling an image for a restore -----------------------------------------------------
    def _image(self, rank: int, step: int, sources: dict) -> tuple[int, dict, str]:
        """A descriptor of (a copy of) rank's image at step, and how it was obtained."""
        with self.lock:
            local = next(
                (
                    s
                    for s in self.slots.values()
                    if s.state == "committed" and (s.rank, s.step) == (rank, step)
                ),
                None,
            )
            if local is not None:
                return os.dup(local.fd), local.meta, "local"
            if (rank, step) in self.restored:
                fd, _, meta, via = self.restored[(rank, step)]
                return os.dup(fd), meta, via
        meta = sources["meta"]
        nbytes, k, m = meta["nbytes"], meta["k"], meta["m"]
        code = Code(k, m)
        frag = code.fragment_len(nbytes)
        fd, mapped = _memfd(max(frag * k, 4096))
        view = memoryview(mapped)
        holders = [a for a in sources["full"] if a != self.id]
        if holders:
            self._get(holders[0], rank, step, FULL, view[:nbytes])
            via = f"copied from agent {holders[0]}"
        else:
            have: dict[int, memoryview | bytearray] = {}
            for j, agent in sorted(sources["frags"].items(), key=lambda kv: int(kv[0])):
                if len(have) == k:
                    break
                j = int(j)
                into = view[j * frag : (j + 1) * frag] if j < k else bytearray(frag)
                if agent == self.id:
                    with self.lock:
                        into[:] = self.frags[(rank, step, j)][0]
                else:
                    self._get(agent, rank, step, j, into)
                have[j] = into
            if len(have) < k:
                raise RuntimeError(
                    f"only {len(have)} of the k={k} fragments of rank {rank} step {step} survive"
                )
            missing = {j: view[j * frag : (j + 1) * frag] for j in range(k) if j not in have}
            if missing:
                code.decode(have, missing)
            via = f"rebuilt from fragments {sorted(have)}"
        if f"{crc32c.crc32c(view[:nbytes]):08x}" != meta["crc"]:
            raise RuntimeError(
                f"the assembled image of rank {rank} step {step} ({via}) fails its checksum"
            )
        del view
        with self.lock:
            self.restored[(rank, step)] = (fd, mapped, meta, via)
        return os.dup(fd), meta, via

    # --- placement on the other nodes ----------------------------------------------------------
    def _place_loop(self) -> None:
        while True:
            slot = self.placements.get()
            try:
                self._place(slot)
            # a peer is gone: the version stays local, the next lease says so
            except Exception as e:
                print(
                    f"snapshot agent {self.id}: placing rank {slot.rank} step {slot.step} failed: "
                    f"{e}",
                    file=sys.stderr,
                    flush=True,
                )
            finally:
                slot.placed.set()

    def _place(self, slot: Slot) -> None:
        """CRC the image, encode k data + m parity fragments, and send fragment j to node (g+j) mod N."""
        nbytes = slot.meta["nbytes"]
        view = memoryview(slot.map)
        crc = f"{crc32c.crc32c(view[:nbytes]):08x}"
        with self.lock:
            nodes, k, m = list(self.nodes), self.k, self.m
            meta = slot.meta = {**slot.meta, "crc": crc, "k": k, "m": m}
        if k + m <= 1 or len(nodes) < 2:
            return
        code = Code(k, m)
        frag = code.fragment_len(nbytes)
        data = [view[i * frag : (i + 1) * frag] for i in range(k)]
        parity = [bytearray(frag) for _ in range(m)]
        start = time.perf_counter()
        if m:
            code.encode(data, parity)
        self.encode_seconds += time.perf_counter() - start
        self.encoded_bytes += nbytes
        home = nodes.index(self.id)
        for j in range(1, k + m):
            target = nodes[(home + j) % len(nodes)]
            payload = data[j] if j < k else parity[j - k]
            self._call(
                target,
                {"op": "put", "rank": slot.rank, "step": slot.step, "j": j, "meta": meta},
                payload,
            )

    # --- agent ↔ agent ------------------------------------------------------------------------
    def _call(self, agent: str, header: dict, payload=None, into=None) -> tuple[dict, object]:
        """One request to a peer agent over its cached, authenticated connection; a cached one the
        peer has closed (it restarted, or dropped us) is replaced once by a fresh one."""
        with self.lock:
            lock, _ = self._peers.setdefault(agent, (threading.Lock(), None))
            host, port = self.agents[agent]
        with lock:
            for attempt in (0, 1):
                chan = self._peers[agent][1]
                fresh = chan is None
                try:
                    if chan is None:
                        chan = Channel.connect(host, port, self.secret)
                        self._peers[agent] = (lock, chan)
                    reply, data = chan.request(header, payload, into)
                    break
                except (OSError, ChannelError):
                    if chan is not None:
                        chan.close()
                    self._peers[agent] = (lock, None)
                    if fresh or attempt:
                        raise
        if not reply.get("ok"):
            raise RuntimeError(f"agent {agent}: {reply.get('error')}")
        return reply, data

    def _get(self, agent: str, rank: int, step: int, j: int, into) -> None:
        self._call(
            agent, {"op": "get", "rank": rank, "step": step, "j": j}, into=lambda header: into
        )

    def _accept_peers(self) -> None:
        while True:
            sock, _ = self.tcp.accept()
            threading.Thread(target=self._serve_peer, args=(sock,), daemon=True).start()

    def _serve_peer(self, sock: socket.socket) -> None:
        try:
            chan = Channel.accept(sock, self.secret)
        except OSError as e:  # AuthError is a PermissionError: a stranger, or a wrong secret
            print(f"snapshot agent {self.id}: refused a peer: {e}", file=sys.stderr, flush=True)
            sock.close()
            return
        try:
            while True:
                try:
                    header, payload = chan.recv()
                except TimeoutError:  # idle between snapshots: the connection stays
                    continue
                if header["op"] == "put":
                    self._store_fragment(header, cast(bytearray, payload))  # recv without `into`
                    chan.send({"ok": True})
                else:
                    chan.send(*self._serve_get(header))
        except (OSError, ChannelError, ValueError):
            chan.close()

    def _store_fragment(self, header: dict, payload: bytearray) -> None:
        rank, step, j = header["rank"], header["step"], header["j"]
        with self.lock:
            stale = [key for key in self.frags if key[0] == rank and key[1] >= step]
            for key in stale:
                del self.frags[key]
            self.frags[(rank, step, j)] = (payload, header["meta"])
            steps = sorted({key[1] for key in self.frags if key[0] == rank})
            for key in [key for key in self.frags if key[0] == rank and key[1] in steps[:-KEEP]]:
                del self.frags[key]

    def _serve_get(self, header: dict) -> tuple[dict, object]:
        rank, step, j = header["rank"], header["step"], header["j"]
        with self.lock:
            if j == FULL:
                slot = next(
                    (
                        s
                        for s in self.slots.values()
                        if s.state == "committed" and (s.rank, s.step) == (rank, step)
                    ),
                    None,
                )
                if slot is not None:
                    return {"ok": True}, memoryview(slot.map)[: slot.meta["nbytes"]]
            elif (rank, step, j) in self.frags:
                return {"ok": True}, self.frags[(rank, step, j)][0]
        what = "image" if j == FULL else f"fragment {j}"
        return {"ok": False, "error": f"no {what} of rank {rank} step {step}"}, None

    def _committed(self, rank: int) -> list[Slot]:
        """The rank's committed slots, oldest commit first (callers hold the lock)."""
        return sorted(
            (s for s in self.slots.values() if s.state == "committed" and s.rank == rank),
            key=lambda s: s.seq,
        )


def main(argv: list[str] | None = None) -> int:
    """Run the agent: parse the command line, check the erasure code, listen on the workers' socket
    and a peer port, and serve until the launcher (`--parent`) is gone."""
    p = argparse.ArgumentParser(
        prog="python -m strata.launch.snapshot_agent", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--socket", required=True, help="path of the workers' Unix socket (in a 0700 directory)"
    )
    p.add_argument(
        "--advertise",
        default=socket.getfqdn(),
        help="host name other nodes' agents reach this one at",
    )
    p.add_argument("--bind", default="0.0.0.0", help="address the peer listener binds")
    p.add_argument("--port", type=int, default=0, help="peer port (0: any free port)")
    p.add_argument("--parent", type=int, help="exit when this process (the launcher) is gone")
    args = p.parse_args(argv)
    # A worker's lease waits for the thread serving it to get the GIL, which a placing thread
    # between its (GIL-free) copies and sends holds for up to a switch interval: 5 ms by default,
    # 0.5 ms here.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    self_test()
    agent = Agent(args.socket, args.advertise, args.bind, args.port, secret_from_env(), args.parent)
    print(
        f"snapshot agent {agent.id}: workers at {args.socket}, peers at "
        f"{agent.address[0]}:{agent.address[1]}",
        flush=True,
    )
    agent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
