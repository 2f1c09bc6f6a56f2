"""Host networking helpers any layer may use (no torch: the launcher imports them before any worker starts)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now, for a local world's rendezvous (launches, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
