"""checkpoint.channel over real sockets on 127.0.0.1: round trips, sequence numbers, a wrong secret,
and a frame-aware man in the middle that tampers with, replays, reflects or cuts frames."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import tracemalloc

import pytest

from strata.checkpoint.channel import (
    MAX_HEADER,
    SECRET_ENV,
    AuthError,
    Channel,
    ChannelError,
    secret_from_env,
)
from strata.errors import StrataError

SECRET = bytes(range(32))
TIMEOUT = 5.0


def _thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _join(t: threading.Thread) -> None:
    t.join(TIMEOUT)
    assert not t.is_alive()


class Server:
    """Accepts `clients` connections in a thread and runs `handler(channel)` on each that passes the
    handshake; every exception raised on the server side lands in `errors`, in order."""

    def __init__(
        self, handler=None, clients: int = 1, secret: bytes = SECRET, timeout: float = TIMEOUT
    ):
        self.handler, self.secret, self.timeout, self.errors = handler, secret, timeout, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = _thread(lambda: [self._serve_one() for _ in range(clients)])

    def _serve_one(self) -> None:
        sock, _ = self.listener.accept()
        try:
            with Channel.accept(sock, self.secret, self.timeout) as ch:
                if self.handler:
                    self.handler(ch)
        except Exception as e:
            self.errors.append(e)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        _join(self.thread)
        self.listener.close()


def echo(ch: Channel) -> None:
    """Reply to every frame with its header under "echo" and the same payload, until the peer closes."""
    while True:
        try:
            header, payload = ch.recv()
        except ChannelError:
            return
        ch.send({"echo": header}, payload)


def pair(timeout: float = TIMEOUT) -> tuple[Channel, Channel]:
    """A connected (client, server) pair, both ends driven from the calling thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    out = {}
    t = _thread(lambda: out.update(server=Channel.accept(listener.accept()[0], SECRET, timeout)))
    client = Channel.connect("127.0.0.1", listener.getsockname()[1], SECRET, timeout)
    _join(t)
    listener.close()
    return client, out["server"]


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


class Proxy:
    """A man in the middle between a client and `server_port` that knows the wire format: it passes
    the handshake through (nonce, then proof, 32 bytes each way) and then reads whole frames
    ([u32 len][header][32-byte MAC][header's nbytes of payload]) and forwards
    `c2s(i, frame)` / `s2c(i, frame)` for the i-th frame of each direction (default: unchanged).
    Each direction's frames as received are kept in `frames["c2s"]` / `frames["s2c"]`.
    Returning a shorter frame forwards it and then closes both connections."""

    def __init__(self, server_port: int, c2s=None, s2c=None):
        self.frames = {"c2s": [], "s2c": []}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads = []
        self.threads.append(_thread(lambda: self._run(server_port, c2s, s2c)))

    def _run(self, server_port, c2s, s2c) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", server_port))
        self.threads += [
            _thread(lambda: self._pump(client, server, "c2s", c2s)),
            _thread(lambda: self._pump(server, client, "s2c", s2c)),
        ]

    def _pump(self, src, dst, direction, tamper) -> None:
        try:
            for _ in range(2):  # nonce, proof
                dst.sendall(_exact(src, 32))
            while True:
                prefix = _exact(src, 4)
                head = _exact(src, struct.unpack("!I", prefix)[0])
                frame = prefix + head + _exact(src, 32) + _exact(src, json.loads(head)["nbytes"])
                i = len(self.frames[direction])
                self.frames[direction].append(frame)
                out = tamper(i, frame) if tamper else frame
                dst.sendall(out)
                if len(out) < len(frame):
                    break
        except (EOFError, OSError):
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            _join(t)
        self.listener.close()


def flip(frame: bytes, index: int) -> bytes:
    b = bytearray(frame)
    b[index] ^= 0x01
    return bytes(b)


# ---- round trips ----------------------------------------------------------------------------------


def test_round_trip_headers_and_payloads():
    src = bytearray(os.urandom((5 << 20) + 10))
    big = memoryview(src)[3 : 3 + (5 << 20)]  # a slice: sent from the caller's buffer
    dst = bytearray((5 << 20) + 20)
    with Server(echo) as server:
        with Channel.connect("127.0.0.1", server.port, SECRET, TIMEOUT) as ch:
            assert ch.peer == ("127.0.0.1", server.port)
            for header, payload in [
                ({"kind": "have?"}, None),
                ({"kind": "empty", "x": [1, None]}, b""),
                ({"kind": "one"}, b"\x7f"),
                ({"kind": "put", "rank": 3, "j": 1}, big),
            ]:
                asked = []

                def into(h):
                    asked.append(h["nbytes"])
                    return memoryview(dst)[7 : 7 + h["nbytes"]]

                reply, got = ch.request(header, payload, into=into)
                assert reply == {"echo": header}  # seq, nbytes, crc stripped
                n = 0 if payload is None else len(payload)
                if n == 0:
                    assert got is None and asked == []  # `into` not called for 0 bytes
                else:
                    assert asked == [n] and got.obj is dst and bytes(got) == bytes(payload)
            assert dst[7 : 7 + len(big)] == big and dst[:7] == bytes(7)
            _, fresh = ch.request({"kind": "again"}, b"abc")  # into=None: a new bytearray
            assert type(fresh) is bytearray and fresh == b"abc"
    assert server.errors == []


def test_several_frames_both_directions_count_separately():
    client, server = pair()
    with client, server:
        for i in range(3):
            client.send({"i": i}, bytes([i]) * (i + 1))
        for i in range(5):
            server.send({"reply": i})
        assert [server.recv() for _ in range(3)] == [
            ({"i": i}, bytearray([i]) * (i + 1)) for i in range(3)
        ]
        assert [client.recv() for _ in range(5)] == [({"reply": i}, None) for i in range(5)]
        assert (client._send_seq, client._recv_seq, server._send_seq, server._recv_seq) == (
            3,
            5,
            5,
            3,
        )


def test_reserved_or_oversize_header_is_refused_before_sending():
    client, server = pair()
    with client, server:
        with pytest.raises(ValueError, match="reserved"):
            client.send({"seq": 7})
        with pytest.raises(ValueError, match="limit"):
            client.send({"blob": "x" * MAX_HEADER})
        client.send({"ok": True})  # nothing was sent: still in step
        assert server.recv() == ({"ok": True}, None)


def test_into_with_the_wrong_size_closes_the_channel():
    client, server = pair()
    with client, server:
        client.send({}, b"12345")
        with pytest.raises(ValueError, match="4 bytes for a 5-byte"):
            server.recv(into=lambda h: bytearray(4))
        with pytest.raises(OSError):
            server.recv()


def test_timeout_before_a_frame_leaves_the_channel_usable():
    client, server = pair(timeout=0.1)
    with client, server:
        with pytest.raises(TimeoutError):
            server.recv()
        client.send({"late": 1}, b"x")
        assert server.recv() == ({"late": 1}, bytearray(b"x"))


# ---- authentication --------------------------------------------------------------------------------


def test_wrong_secret_is_refused_and_the_server_serves_the_next_client():
    with Server(echo, clients=2) as server:
        with pytest.raises(AuthError):
            Channel.connect("127.0.0.1", server.port, b"not the secret, but 32 bytes ...", TIMEOUT)
        with Channel.connect("127.0.0.1", server.port, SECRET, TIMEOUT) as ch:
            assert ch.request({"n": 1}, b"ok") == ({"echo": {"n": 1}}, bytearray(b"ok"))
    assert len(server.errors) == 1 and isinstance(server.errors[0], AuthError)


def test_client_refuses_a_server_with_the_wrong_secret():
    with Server(secret=b"another secret of 32 bytes .....") as server:
        with pytest.raises(AuthError):
            Channel.connect("127.0.0.1", server.port, SECRET, TIMEOUT)
    assert len(server.errors) == 1 and isinstance(server.errors[0], AuthError)


def test_server_sends_only_a_nonce_before_the_client_proves_the_secret():
    with Server() as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as raw:
            raw.sendall(os.urandom(32) + os.urandom(32))  # a nonce and a made-up proof
            received = b""
            while chunk := raw.recv(4096):
                received += chunk
            assert len(received) == 32  # its nonce, then it hung up
    assert isinstance(server.errors[0], AuthError)


def test_a_peer_that_hangs_up_during_the_handshake_is_an_auth_error():
    with Server() as server:
        socket.create_connection(("127.0.0.1", server.port)).close()
    assert isinstance(server.errors[0], AuthError)


# ---- a man in the middle -----------------------------------------------------------------------------


def _through_proxy(c2s=None, s2c=None, handler=None, client_side=None):
    """Run `handler` on the server and `client_side(channel)` on a client that goes through a Proxy;
    returns (server errors, proxy frames)."""

    def recv_all(ch):
        while True:
            ch.recv()

    with Server(handler or recv_all) as server, Proxy(server.port, c2s, s2c) as proxy:
        with Channel.connect("127.0.0.1", proxy.port, SECRET, TIMEOUT) as ch:
            client_side(ch)
    return server.errors, proxy.frames


def test_untouched_frames_pass_the_proxy():
    def client_side(ch):
        assert ch.request({"kind": "get"}, b"abc") == ({"echo": {"kind": "get"}}, bytearray(b"abc"))

    errors, frames = _through_proxy(handler=echo, client_side=client_side)
    assert errors == [] and len(frames["c2s"]) == len(frames["s2c"]) == 1


@pytest.mark.parametrize("where", ["header", "mac"])
def test_tampered_header_or_mac_is_an_auth_error(where):
    def c2s(i, frame):
        return flip(frame, 4 + 3 if where == "header" else len(frame) - 1000 - 1)

    errors, _ = _through_proxy(
        c2s, client_side=lambda ch: ch.send({"kind": "put", "step": 4}, bytes(1000))
    )
    assert len(errors) == 1 and isinstance(errors[0], AuthError) and "bad MAC" in str(errors[0])


def test_tampered_payload_is_a_crc_error():
    errors, _ = _through_proxy(
        lambda i, frame: flip(frame, len(frame) - 10),
        client_side=lambda ch: ch.send({"kind": "put"}, os.urandom(1000)),
    )
    assert len(errors) == 1 and isinstance(errors[0], ChannelError) and "CRC" in str(errors[0])


def test_replayed_frame_is_an_auth_error():
    proxy_frames = []

    def c2s(i, frame):
        proxy_frames.append(frame)
        return proxy_frames[0]  # frame 0, again and again

    def client_side(ch):
        ch.send({"kind": "durable", "step": 1})
        ch.send({"kind": "durable", "step": 2})

    got = []

    def handler(ch):
        got.append(ch.recv())
        ch.recv()

    errors, _ = _through_proxy(c2s, handler=handler, client_side=client_side)
    assert got == [({"kind": "durable", "step": 1}, None)]
    assert (
        len(errors) == 1
        and isinstance(errors[0], AuthError)
        and "sequence number 0, expected 1" in str(errors[0])
    )


def test_frame_from_another_connection_is_an_auth_error():
    first = _through_proxy(client_side=lambda ch: ch.send({"kind": "durable", "step": 1}))[1][
        "c2s"
    ][0]
    errors, _ = _through_proxy(
        lambda i, frame: first, client_side=lambda ch: ch.send({"kind": "durable", "step": 1})
    )
    assert len(errors) == 1 and isinstance(errors[0], AuthError) and "bad MAC" in str(errors[0])


def test_frame_reflected_back_to_its_sender_is_an_auth_error():
    from_server = []

    def s2c(i, frame):
        from_server.append(frame)
        return frame

    def handler(ch):  # sends seq 0, then expects seq 0
        ch.send({"kind": "have?"})
        ch.recv()

    errors, _ = _through_proxy(
        lambda i, frame: from_server[0],
        s2c,
        handler=handler,
        client_side=lambda ch: (ch.recv(), ch.send({"kind": "holdings"})),
    )
    assert len(errors) == 1 and isinstance(errors[0], AuthError) and "bad MAC" in str(errors[0])


def test_connection_closed_mid_frame_is_a_channel_error():
    errors, _ = _through_proxy(
        lambda i, frame: frame[:-90], client_side=lambda ch: ch.send({"kind": "put"}, bytes(100))
    )
    assert (
        len(errors) == 1 and isinstance(errors[0], ChannelError) and "mid-frame" in str(errors[0])
    )


@pytest.mark.parametrize("length", [MAX_HEADER + 1, 0xFFFFFFFF])
def test_oversize_header_length_is_refused_without_allocating(length):
    client, server = pair()
    with client, server:
        client._sock.sendall(struct.pack("!I", length))
        tracemalloc.start()
        try:
            with pytest.raises(ChannelError, match="header length"):
                server.recv()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 10


# ---- the secret ---------------------------------------------------------------------------------------


def test_secret_from_env():
    hexed = "ab" * 32
    assert secret_from_env({SECRET_ENV: hexed}) == bytes.fromhex(hexed)
    assert secret_from_env({SECRET_ENV: hexed.upper() + "\n"}) == bytes.fromhex(hexed)
    with pytest.raises(StrataError, match=f"{SECRET_ENV} is not set.*secrets.token_hex\\(32\\)"):
        secret_from_env({})
    for bad in ["ab" * 31, "zz" * 32, "ab " * 32]:
        with pytest.raises(StrataError, match=f"{SECRET_ENV} must be 64 hex characters") as e:
            secret_from_env({SECRET_ENV: bad})
        assert bad.strip() not in str(e.value)  # the secret is never echoed


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Channel.connect("127.0.0.1", 1, b"short")
