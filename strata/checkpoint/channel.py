"""Authenticated, framed TCP between snapshot agents on different nodes (docs/design/snapshot.md §3.2):
a mutual HMAC-SHA256 challenge from the per-job secret `STRATA_SNAPSHOT_SECRET`, then frames whose
headers carry an HMAC and a sequence number and whose payloads carry a CRC-32C.

Our own rather than a library: torch's TCPStore and gloo have no authentication, and Python 3.11's
`ssl` has no TLS-PSK (`set_psk_*_callback` is 3.13+), so TLS would need certificates. Headers are
MACed; payloads are only CRC-checked (a MAC would cost ~0.6 ms/MB of CPU on cores shared with the
workers), and nothing is encrypted, like gloo and NCCL traffic. Imports no torch: it runs in the agent.

Wire format, after the handshake, per frame:
    [u32 big-endian header length][header: JSON object with seq, nbytes, crc][32-byte MAC][payload]
MAC = HMAC-SHA256(session key, sender role ("client" or "server") + header bytes): the role stops a
frame from being reflected back to its sender. `seq` counts frames from 0 in each direction.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import struct
from collections.abc import Callable, Mapping

import crc32c

from strata.errors import StrataError

SECRET_ENV = "STRATA_SNAPSHOT_SECRET"
MAX_HEADER = 1 << 20  # a longer header is refused before anything is allocated for it
NONCE = MAC = 32
_LEN = struct.Struct("!I")
_INTERNAL = ("seq", "nbytes", "crc")
_ROLES = (b"client", b"server")


class AuthError(PermissionError):
    """The peer failed the handshake, or a frame has a bad MAC or an unexpected sequence number."""


class ChannelError(ConnectionError):
    """A framing error, a payload CRC mismatch, or the peer closed the connection mid-frame."""


def secret_from_env(env: Mapping[str, str] = os.environ) -> bytes:
    """The per-job secret: `STRATA_SNAPSHOT_SECRET`, 64 hex characters, as 32 bytes."""
    how = (
        "set it to the same 64 hex characters on every node of the job, e.g. "
        "python -c 'import secrets; print(secrets.token_hex(32))'"
    )
    value = env.get(SECRET_ENV)
    if value is None:
        raise StrataError(
            f"{SECRET_ENV} is not set; snapshot agents authenticate each other with it: {how}"
        )
    value = value.strip()
    if not re.fullmatch(r"[0-9a-fA-F]{64}", value):  # never echo the value: it is a secret
        raise StrataError(
            f"{SECRET_ENV} must be 64 hex characters (32 bytes), got {len(value)} characters"
            f"{'' if re.fullmatch(r'[0-9a-fA-F]*', value) else ' including non-hex ones'}: {how}"
        )
    return bytes.fromhex(value)


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.digest(key, msg, hashlib.sha256)


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from the socket; each recv may wait up to the socket timeout. Returns the bytes'
    CRC-32C, computed piece by piece as they arrive, while they are still in cache."""
    got, n, crc = 0, view.nbytes, 0
    while got < n:
        r = sock.recv_into(view[got:])
        if not r:
            raise ChannelError(
                f"peer closed the connection mid-frame ({got} of {n} bytes received)"
            )
        crc = crc32c.crc32c(view[got : got + r], crc)
        got += r
    return crc


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg until every byte of `views` is sent: one syscall for header and payload, no copy."""
    views = [v for v in views if v.nbytes]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def _byte_view(buf) -> memoryview:
    view = memoryview(buf)
    # cast: C-contiguous only
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _handshake(sock: socket.socket, secret: bytes, server: bool) -> bytes:
    """Mutual challenge-response; returns the session key. The server sends nothing but its nonce
    before the client has proven the secret."""
    mine = secrets.token_bytes(NONCE)
    sock.sendall(mine)
    theirs = _recv_exact(sock, NONCE)
    server_nonce, client_nonce = (mine, theirs) if server else (theirs, mine)
    client_proof = _mac(secret, b"client" + server_nonce + client_nonce)
    server_proof = _mac(secret, b"server" + client_nonce + server_nonce)
    if server:
        if not hmac.compare_digest(_recv_exact(sock, MAC), client_proof):
            raise AuthError("peer failed authentication: it does not know the snapshot secret")
        sock.sendall(server_proof)
    else:
        sock.sendall(client_proof)
        try:
            proof = _recv_exact(sock, MAC)
        except ConnectionError as e:  # EOF or reset: how a server refuses our proof
            raise AuthError(
                "server closed the connection instead of proving the snapshot secret "
                f"(different {SECRET_ENV} on the two nodes?)"
            ) from e
        if not hmac.compare_digest(proof, server_proof):
            raise AuthError("server failed authentication: it does not know the snapshot secret")
    return _mac(secret, b"session" + server_nonce + client_nonce)


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ValueError("the channel secret must be at least 16 bytes (see secret_from_env)")


class Channel:
    """One authenticated connection; requests/replies are whole frames. Not thread-safe: callers hold
    a lock per channel.

    Timeouts: `timeout` is the socket timeout, for the handshake and afterwards. It bounds each
    blocking socket call, i.e. how long the peer may make no progress, not a whole frame, so large
    payloads need no larger timeout. A TimeoutError from `recv` before any byte of the next frame
    arrived leaves the channel usable (an idle server loop may wait again); every other error from
    `send` or `recv`, including a timeout mid-frame, closes the channel: open a new one.
    """

    def __init__(self, sock: socket.socket, key: bytes, server: bool, peer: tuple):
        self._sock, self._key, self.peer = sock, key, peer
        self._send_role, self._recv_role = (_ROLES[1], _ROLES[0]) if server else _ROLES
        self._send_seq = self._recv_seq = 0

    @classmethod
    def connect(cls, host: str, port: int, secret: bytes, timeout: float = 10.0) -> Channel:
        """Connect to a peer agent and authenticate both ways; AuthError if the peer does not prove
        the secret or refuses ours."""
        _check_secret(secret)
        sock = socket.create_connection((host, port), timeout=timeout)
        return cls._open(sock, secret, timeout, server=False)

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, timeout: float = 10.0) -> Channel:
        """The server side of a socket from `listener.accept()`. Raises AuthError, and closes the
        socket, if the peer does not prove the secret (a wrong proof, or it hangs up first); a
        TimeoutError (socket closed too) if it stays silent for `timeout`."""
        _check_secret(secret)
        try:
            return cls._open(sock, secret, timeout, server=True)
        except ConnectionError as e:  # EOF or reset (AuthError itself is no ConnectionError)
            raise AuthError("peer closed the connection before proving the snapshot secret") from e

    @classmethod
    def _open(cls, sock: socket.socket, secret: bytes, timeout: float, server: bool) -> Channel:
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = sock.getpeername()
            return cls(sock, _handshake(sock, secret, server), server, peer)
        except BaseException:
            sock.close()
            raise

    def send(self, header: dict, payload=None) -> None:
        """Send one frame: `header` (a JSON-serializable dict) and `payload` (any C-contiguous
        buffer-protocol object, or None), sent straight from the caller's buffer."""
        if any(k in header for k in _INTERNAL):
            raise ValueError(
                f"header keys {_INTERNAL} are reserved for the channel: {sorted(header)}"
            )
        view = _byte_view(payload) if payload is not None else memoryview(b"")
        head = json.dumps(
            {**header, "seq": self._send_seq, "nbytes": view.nbytes, "crc": crc32c.crc32c(view)},
            separators=(",", ":"),
        ).encode()
        if len(head) > MAX_HEADER:
            raise ValueError(f"frame header is {len(head)} bytes; the limit is {MAX_HEADER}")
        prefix = _LEN.pack(len(head)) + head + _mac(self._key, self._send_role + head)
        try:  # nothing was sent before this point, so the errors above leave the channel usable
            _sendmsg_all(self._sock, [memoryview(prefix), view])
        except BaseException:
            self.close()
            raise
        self._send_seq += 1

    def recv(self, into: Callable[[dict], object] | None = None) -> tuple[dict, object]:
        """Receive one frame: (header without seq/nbytes/crc, payload or None when it has no bytes).
        `into`: None (the payload goes into a new bytearray) or a callable that gets the full header
        (with "nbytes") and returns a writable buffer of exactly that many bytes, received straight
        into; it is not called for an empty payload. Raises AuthError for a bad MAC or sequence
        number and ChannelError for a framing error, a CRC mismatch or a closed connection."""
        first, n = bytearray(_LEN.size), 0
        try:
            n = self._sock.recv_into(first)
            if not n:
                raise ChannelError(f"peer {self.peer} closed the connection")
            _recv_into(self._sock, memoryview(first)[n:])
            return self._recv_rest(_LEN.unpack(first)[0], into)
        except BaseException as e:
            if n or not isinstance(e, TimeoutError):  # a timeout before any byte consumed nothing
                self.close()
            raise

    def _recv_rest(self, length: int, into) -> tuple[dict, object]:
        if length > MAX_HEADER:
            raise ChannelError(
                f"frame header length {length} exceeds {MAX_HEADER} (not a snapshot channel?)"
            )
        raw = _recv_exact(self._sock, length + MAC)
        head, mac = raw[:length], raw[length:]
        if not hmac.compare_digest(mac, _mac(self._key, self._recv_role + head)):
            raise AuthError(f"frame from {self.peer} has a bad MAC (tampered or corrupted)")
        header = self._parse(head)
        if header["seq"] != self._recv_seq:
            raise AuthError(
                f"frame from {self.peer} has sequence number {header['seq']}, "
                f"expected {self._recv_seq} (replayed or reordered)"
            )
        self._recv_seq += 1
        nbytes, payload = header["nbytes"], None
        if nbytes:
            payload = bytearray(nbytes) if into is None else into(header)
            view = _byte_view(payload)
            if view.readonly or view.nbytes != nbytes:
                raise ValueError(
                    f"`into` gave a {'read-only ' if view.readonly else ''}buffer of "
                    f"{view.nbytes} bytes for a {nbytes}-byte payload"
                )
            if _recv_into(self._sock, view) != header["crc"]:
                raise ChannelError(
                    f"payload from {self.peer} fails its CRC-32C ({nbytes} bytes, corrupted)"
                )
        return {k: v for k, v in header.items() if k not in _INTERNAL}, payload

    @staticmethod
    def _parse(head: bytes) -> dict:
        try:
            header = json.loads(head)
        except ValueError as e:
            raise ChannelError(f"frame header is not JSON: {e}") from e
        if not isinstance(header, dict) or not all(
            type(header.get(k)) is int and header[k] >= 0 for k in _INTERNAL
        ):
            raise ChannelError("frame header lacks a non-negative integer seq, nbytes or crc")
        return header

    def request(
        self, header: dict, payload=None, into: Callable[[dict], object] | None = None
    ) -> tuple[dict, object]:
        """Send a frame, then receive the reply (see `recv`)."""
        self.send(header, payload)
        return self.recv(into)

    def close(self) -> None:
        """Close the connection (idempotent); shutdown first wakes a thread blocked on it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
