"""Snapshot agents as real processes, without a torch world: images handed over through their Unix
sockets, erasure-coded across agents, agents SIGKILLed, and images rebuilt bit for bit from the
survivors' fragments; access control of both sockets."""

from __future__ import annotations

import mmap
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from strata.checkpoint.agent_protocol import connect, request
from strata.checkpoint.channel import AuthError, Channel
from strata.checkpoint.snapshot import _newest_complete, _sources

from worlds import start_agents

SECRET = "ab" * 32


class Agents:
    """N agent processes, each with one 'worker' connection, placed as nodes 0..N-1."""

    def __init__(self, tmp: Path, n: int, k: int, m: int):
        self.procs, self.socks, self.info, self.maps = [], [], [], {}
        directory = tmp / "sockets"
        directory.mkdir(mode=0o700)
        self.info = [str(directory / f"agent{g}.sock") for g in range(n)]
        self.procs = start_agents(self.info, SECRET)
        self.paths = list(self.info)
        self.socks = [connect(p, 10) for p in self.paths]
        hellos = [request(s, {"op": "hello", "rank": g})[0] for g, s in enumerate(self.socks)]
        agents = [[h["agent"], h["host"], h["port"]] for h in hellos]
        self.ids = [h["agent"] for h in hellos]
        for s in self.socks:
            assert request(s, {"op": "peers", "agents": agents, "nodes": self.ids, "k": k, "m": m})[
                0
            ]["ok"]

    def commit(self, rank: int, step: int, image: bytes, world: int) -> None:
        sock = self.socks[rank]
        reply, fds = request(sock, {"op": "lease", "rank": rank, "nbytes": len(image)})
        assert reply["ok"], reply
        if fds:  # a descriptor comes once per slot and connection, as to a worker
            self.maps[(rank, reply["slot"])] = mmap.mmap(fds[0], reply["size"])
            os.close(fds[0])
        self.maps[(rank, reply["slot"])][: len(image)] = image
        meta = {
            "rank": rank,
            "step": step,
            "world": world,
            "nbytes": len(image),
            "data": len(image),
            "trailer": 0,
        }
        assert request(sock, {"op": "commit", "slot": reply["slot"], "meta": meta})[0]["ok"]

    def wait_placed(self, step: int) -> None:
        deadline = time.monotonic() + 20
        for s in self.socks:
            while request(s, {"op": "stats"})[0]["placed_step"] < step:
                assert time.monotonic() < deadline, "placement did not finish"
                time.sleep(0.01)

    def kill(self, g: int) -> None:
        self.procs[g].kill()
        self.procs[g].wait()

    def fetch(
        self, via: int, step: int, ranks: list[int], alive: list[int]
    ) -> tuple[dict, dict[int, bytes]]:
        holdings = {self.ids[g]: request(self.socks[g], {"op": "holdings"})[0] for g in alive}
        sources = _sources(holdings)
        reply, fds = request(
            self.socks[via],
            {
                "op": "fetch",
                "step": step,
                "ranks": ranks,
                "sources": {str(r): sources[step][r] for r in ranks},
            },
        )
        images = {}
        for r, fd in zip(ranks, fds):
            size = reply["metas"][str(r)]["nbytes"]
            images[r] = os.pread(fd, size, 0)
            os.close(fd)
        return reply, images

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def agents(tmp_path):
    made = []

    def make(n, k, m):
        made.append(Agents(tmp_path, n, k, m))
        return made[-1]

    yield make
    for a in made:
        a.close()


@pytest.mark.parametrize("n,k,m", [(3, 2, 1), (6, 4, 2)])
def test_images_survive_the_loss_of_m_agents_and_not_more(agents, n, k, m):
    a = agents(n, k, m)
    images = {
        r: os.urandom(300_000 + 4097 * r) for r in range(n)
    }  # lengths not multiples of k or 64
    for step in (1, 2):
        for r in range(n):
            a.commit(r, step, images[r] if step == 2 else os.urandom(1000), world=n)
        a.wait_placed(step)
    dead = list(range(1, m + 1))
    for g in dead:
        a.kill(g)
    alive = [g for g in range(n) if g not in dead]
    holdings = {a.ids[g]: request(a.socks[g], {"op": "holdings"})[0] for g in alive}
    assert _newest_complete(_sources(holdings))[0] == 2
    reply, got = a.fetch(0, 2, list(range(n)), alive)
    assert reply["ok"], reply
    for r in range(n):
        assert got[r] == images[r], f"rank {r}"
    for r in dead:
        assert reply["how"][str(r)].startswith("rebuilt from fragments"), reply["how"]
    assert reply["how"]["0"] == "local"

    a.kill(m + 1)  # one more than m: the ranks of the first dead agent have only k-1 fragments left
    alive.remove(m + 1)
    holdings = {a.ids[g]: request(a.socks[g], {"op": "holdings"})[0] for g in alive}
    step, why = _newest_complete(_sources(holdings))
    assert step is None
    assert f"of k={k} fragments" in why, why


def test_newest_version_wins_and_rolled_back_versions_go(agents):
    a = agents(2, 1, 1)
    for step, fill in (
        (1, b"a"),
        (2, b"b"),
        (3, b"c"),
        (2, b"d"),
    ):  # after a restore from 2, step 2 again
        for r in range(2):
            a.commit(r, step, fill * 5000, world=2)
        a.wait_placed(step)
    held = request(a.socks[0], {"op": "holdings"})[0]
    # 1 went when 3 came (2 versions kept); 3 and the old 2 went when the restored run committed 2 again
    assert sorted(s for r, s, _ in held["full"] if r == 0) == [2]
    reply, got = a.fetch(1, 2, [0], [0, 1])
    assert got[0] == b"d" * 5000


def test_socket_is_private_and_peers_need_the_secret(agents):
    a = agents(2, 1, 1)
    mode = os.stat(a.paths[0]).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    hello = request(a.socks[0], {"op": "hello", "rank": 0})[0]
    host, port = hello["host"], hello["port"]
    raw = socket.create_connection((host, port))
    raw.sendall(b"\0" * 64)  # garbage instead of a proof of the secret
    raw.close()
    with pytest.raises(AuthError):
        Channel.connect(host, port, bytes.fromhex("cd" * 32))
    good = Channel.connect(host, port, bytes.fromhex(SECRET))  # the agent still serves after both
    reply, _ = good.request({"op": "get", "rank": 0, "step": 99, "j": -1})
    assert not reply["ok"] and "no image of rank 0 step 99" in reply["error"]
    good.close()


def test_worker_side_errors_name_the_fix(agents):
    from strata.checkpoint.snapshot import SnapshotManager
    from strata.config import SnapshotConfig
    from strata.errors import StrataError

    with pytest.raises(StrataError, match="STRATA_SNAPSHOT_SOCKET"):
        SnapshotManager(SnapshotConfig(every_steps=1), 0, 1, None, env={})
    a = agents(1, 1, 0)
    with pytest.raises(
        StrataError, match=r"snapshot.k \+ snapshot.m = 1 \+ 1 .* this job has 1; set snapshot.m=0"
    ):
        SnapshotManager(
            SnapshotConfig(every_steps=1, k=1, m=1),
            0,
            1,
            None,
            env={"STRATA_SNAPSHOT_SOCKET": a.paths[0]},
        )
    manager = SnapshotManager(
        SnapshotConfig(every_steps=1, m=0), 0, 1, None, env={"STRATA_SNAPSHOT_SOCKET": a.paths[0]}
    )
    manager.close()


def test_a_slot_stays_with_its_rank(agents):
    """A worker writes its blob headers into a slot once; a slot must never go to another rank."""
    a = agents(1, 1, 0)
    workers = {0: a.socks[0], 1: connect(a.paths[0], 10)}
    slots: dict[int, set] = {0: set(), 1: set()}
    for step in range(1, 6):
        for rank, sock in workers.items():
            reply, fds = request(sock, {"op": "lease", "rank": rank, "nbytes": 10_000})
            for fd in fds:
                os.close(fd)
            slots[rank].add(reply["slot"])
            meta = {
                "rank": rank,
                "step": step,
                "world": 2,
                "nbytes": 10_000,
                "data": 10_000,
                "trailer": 0,
            }
            assert request(sock, {"op": "commit", "slot": reply["slot"], "meta": meta})[0]["ok"]
        a.wait_placed(step)
    assert len(slots[0]) == 3 and not slots[0] & slots[1]  # 2 kept + 1 being written, per rank
    workers[1].close()


def test_two_versions_of_one_step_are_never_combined():
    """A step saved twice (rolled back and replayed, or an agent restarted between) can leave images
    and fragments of both versions; recovery takes one version's pieces only: the one whose home
    agent holds the whole image, else the most recently saved."""
    old = {
        "rank": 0,
        "step": 5,
        "world": 1,
        "nbytes": 8,
        "k": 2,
        "m": 1,
        "crc": "0000000a",
        "saved_at": 1.0,
    }
    new = {**old, "crc": "0000000b", "saved_at": 2.0}
    fragments_only = {
        "X": {"full": [], "frags": [[0, 5, 1, old], [0, 5, 2, old]]},
        "Y": {"full": [], "frags": [[0, 5, 0, new], [0, 5, 2, new]]},
        "Z": {"full": [], "frags": [[0, 5, 1, new]]},
    }
    entry = _sources(fragments_only)[5][0]
    assert entry["meta"]["crc"] == new["crc"] and entry["frags"] == {"0": "Y", "2": "Y", "1": "Z"}
    with_image = {**fragments_only, "W": {"full": [[0, 5, old]], "frags": []}}
    entry = _sources(with_image)[5][0]
    assert (
        entry["meta"]["crc"] == old["crc"]
        and entry["full"] == ["W"]
        and entry["frags"] == {"1": "X", "2": "X"}
    )
    mixed = {
        "X": {"full": [], "frags": [[0, 5, 1, old]]},
        "Y": {"full": [], "frags": [[0, 5, 0, new]]},
    }
    step, why = _newest_complete(_sources(mixed))  # one fragment of each: not k=2 of either
    assert step is None and "1 of k=2 fragments" in why
