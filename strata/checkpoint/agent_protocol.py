"""The messages between a training worker and its node's snapshot agent: one JSON object per
SOCK_SEQPACKET record over the agent's Unix socket, file descriptors attached (the memfd slots).
Both sides import it: the workers' `checkpoint.snapshot` and the agent process, `launch.snapshot_agent`."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence

SOCKET_ENV = "STRATA_SNAPSHOT_SOCKET"
MAX_MESSAGE = 1 << 20


def send_msg(sock: socket.socket, msg: dict, fds: Sequence[int] = ()) -> None:
    """Send one message (a JSON object) as one record, with file descriptors `fds` attached."""
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def recv_msg(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and its descriptors; (None, []) when the peer has gone."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 256)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def request(sock: socket.socket, msg: dict) -> tuple[dict, list[int]]:
    """Send `msg` and wait for the agent's reply and its descriptors; ConnectionError if the agent has gone."""
    send_msg(sock, msg)
    reply, fds = recv_msg(sock)
    if reply is None:
        raise ConnectionError("the snapshot agent closed the connection")
    return reply, fds


def connect(path: str, timeout: float) -> socket.socket:
    """A SOCK_SEQPACKET connection to the agent's Unix socket at `path`, with `timeout` on every call."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def agent_stats(path: str, timeout: float = 5.0) -> dict:
    """An agent's encode throughput and newest placed step (benchmarks and tests)."""
    sock = connect(path, timeout)
    try:
        return request(sock, {"op": "stats"})[0]
    finally:
        sock.close()
