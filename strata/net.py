"""Host networking helpers any layer may use (no torch: the launcher imports them before any worker starts):
free ports, endpoints, this node's own addresses and interfaces."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any


def free_port() -> int:
    """A TCP port free on this host now, for a local world's rendezvous (launches, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """HOST:PORT (HOST alone, [IPv6]:PORT) as (host, port or None); ValueError for a port that is
    not 1..65535."""
    host, colon, port = endpoint.rpartition(":")
    if not colon or "]" in port:  # HOST alone (an IPv6 address without a port, too)
        return endpoint.strip("[]"), None
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{endpoint!r}: the port must be 1..65535")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """A loopback address, or localhost."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def resolve(host: str, port: int | None = None) -> list[tuple[int, tuple[Any, ...]]]:
    """(family, socket address) of every TCP address `host` resolves to; none when it does not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(family, addr) for family, _, _, _, addr in infos]


def bind_errno(family: int, addr: tuple[Any, ...]) -> int:
    """0 when a listening socket could bind `addr` now, else the errno (EADDRNOTAVAIL: not an address of
    this node; EADDRINUSE: something listens there)."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as TCPStore: TIME_WAIT leftovers do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.errno or -1
    return 0


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of this node's interface `ifname`, or None (no such interface, no IPv4)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])
