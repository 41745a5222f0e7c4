"""The TCP handshake: connections without the job secret are dropped, logged, and store nothing."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from memsnap.errors import TransportError
from memsnap.localcluster import wait_for
from memsnap.transport import ChunkKey, auth, make_transport, wire

SECRET = os.urandom(32)


class Store:
    def __init__(self):
        self.reserved, self.held = [], {}

    def reserve(self, key, nbytes):
        self.reserved.append(key)
        return memoryview(bytearray(nbytes))

    def complete(self, key, checksum):
        self.held[key] = checksum

    def discard(self, key):
        pass

    def lookup(self, key):
        return None


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("MEMSNAP_TCP_HANDSHAKE_TIMEOUT_S", "1.0")
    store = Store()
    t = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    addr = t.start(store)
    try:
        yield store, addr
    finally:
        t.close()


def _push_frame() -> bytes:
    key = ChunkKey(1, "intruder", 0, 0).pack()
    return wire.REQUEST.pack(wire.PUSH, len(key), 4, 0, 1) + key + b"evil"


def _dropped(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (read until EOF or reset)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _logged_drop(caplog, port: int) -> bool:
    return any(f"dropped data-plane connection from 127.0.0.1:{port}" in r.getMessage() for r in caplog.records)


def test_connection_without_the_secret_is_dropped_and_logged(server, caplog):
    store, addr = server
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
        port = sock.getsockname()[1]
        sock.sendall(_push_frame() * 3)  # frames straight away, no handshake
        assert _dropped(sock)
    wait_for(lambda: _logged_drop(caplog, port), timeout=10, what="the drop to be logged")
    assert store.reserved == [] and store.held == {}


def test_silent_connection_is_dropped_after_the_handshake_timeout(server, caplog):
    store, addr = server
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
        port = sock.getsockname()[1]
        assert _dropped(sock)
    wait_for(lambda: _logged_drop(caplog, port), timeout=10, what="the drop to be logged")
    assert store.reserved == []


def test_wrong_secret_is_dropped_and_logged(server, caplog):
    store, addr = server
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
        port = sock.getsockname()[1]
        hello = wire.recv_exact(sock, len(auth.MAGIC) + 1 + auth.NONCE, _soon())
        nonce, mode = os.urandom(auth.NONCE), hello[len(auth.MAGIC) : len(auth.MAGIC) + 1]
        bad = auth._mac(os.urandom(32), b"client", mode, hello[len(auth.MAGIC) + 1 :], nonce)
        sock.sendall(auth.MAGIC + mode + nonce + bad + _push_frame())
        assert _dropped(sock)
    wait_for(lambda: _logged_drop(caplog, port), timeout=10, what="the drop to be logged")
    assert any("proof" in r.getMessage() for r in caplog.records)
    assert store.reserved == [] and store.held == {}


def test_client_with_a_wrong_secret_cannot_push(server, caplog):
    store, addr = server
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    client = make_transport("tcp", secret=os.urandom(32), host="127.0.0.1")
    try:
        with pytest.raises(TransportError, match="cannot connect"):
            client.push(addr, [(ChunkKey(1, "x", 0, 0), memoryview(b"data"))], timeout=10)
    finally:
        client.close()
    wait_for(
        lambda: any("authentication failed" in r.getMessage() for r in caplog.records),
        timeout=10,
        what="the drop to be logged",
    )
    assert store.reserved == [] and store.held == {}


def test_right_secret_is_accepted(server):
    store, addr = server
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    try:
        client.push(addr, [(ChunkKey(1, "x", 0, 0), memoryview(b"data"))], timeout=10)
    finally:
        client.close()
    assert list(store.held) == [ChunkKey(1, "x", 0, 0)]


def _drain(conn) -> list[bytes]:
    """Everything ``conn`` receives until the peer closes it or 5 s pass in silence."""
    got = []
    conn.settimeout(5)
    try:
        while chunk := conn.recv(4096):
            got.append(chunk)
    except OSError:
        pass
    return got


def _push_to(serve, payload: bytes, *, match: str) -> None:
    """Push ``payload`` to a fake server that runs ``serve(conn)`` on the one connection it
    accepts; the push must fail with a TransportError matching ``match``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept_one():
        conn, _ = listener.accept()
        with conn:
            serve(conn)

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    try:
        with pytest.raises(TransportError, match=match):
            client.push(
                {"host": "127.0.0.1", "port": listener.getsockname()[1]},
                [(ChunkKey(1, "x", 0, 0), memoryview(payload))],
                timeout=10,
            )
    finally:
        client.close()
        thread.join(timeout=10)
        listener.close()


def test_client_refuses_a_server_without_the_secret():
    """Mutual: a server that cannot prove the secret gets nothing pushed to it."""
    received = []

    def impostor(conn):
        conn.sendall(auth.MAGIC + b"\0" + os.urandom(auth.NONCE))
        wire.recv_exact(conn, len(auth.MAGIC) + 1 + auth.NONCE + auth.MAC, _soon())
        conn.sendall(os.urandom(auth.MAC))
        received.extend(_drain(conn))

    _push_to(impostor, b"secret payload", match="server's proof")
    assert b"secret payload" not in b"".join(received)


def test_agents_of_another_protocol_version_are_refused_by_name(server, caplog):
    """A version-3 agent (its pushes carry the pusher's checksum; a version-4 holder computes
    its own) and this one refuse each other at the handshake, saying why, before any frame is
    exchanged."""
    _, addr = server

    def old_server(conn):
        conn.sendall(b"MEMSNAP3" + b"\0" + os.urandom(auth.NONCE))
        _drain(conn)

    _push_to(old_server, b"x", match="server speaks data-plane protocol MEMSNAP3, this agent MEMSNAP4")
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:  # an old client
        port = sock.getsockname()[1]
        wire.recv_exact(sock, len(auth.MAGIC) + 1 + auth.NONCE, _soon())
        sock.sendall(b"MEMSNAP3" + b"\0" + os.urandom(auth.NONCE + auth.MAC))
        assert _dropped(sock)
    wait_for(lambda: _logged_drop(caplog, port), timeout=10, what="the drop to be logged")
    assert any(
        "client speaks data-plane protocol MEMSNAP3, this agent MEMSNAP4" in r.getMessage() for r in caplog.records
    )


def test_the_secret_never_crosses_the_wire():
    a, b = socket.socketpair()
    sent = []
    with a, b:
        errors = []
        server = threading.Thread(target=lambda: _catch(errors, auth.server_handshake, b, SECRET, _soon()))
        server.start()
        wrapped = _Spy(a, sent)
        auth.client_handshake(wrapped, SECRET, _soon())
        server.join(timeout=10)
    assert not errors
    assert SECRET not in b"".join(sent)


class _Spy:
    """A socket stand-in that records what is sent."""

    def __init__(self, sock, sent):
        self.sock, self.sent = sock, sent

    def send(self, data):
        n = self.sock.send(data)
        self.sent.append(bytes(data[:n]))
        return n

    def recv_into(self, *args):
        return self.sock.recv_into(*args)

    def setsockopt(self, *args):
        return self.sock.setsockopt(*args)


def _soon() -> float:
    return time.monotonic() + 10


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        errors.append(exc)


def test_short_secrets_are_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"length 3.*os.urandom\(32\)"):
        auth.check_secret(b"abc")
    with pytest.raises(ValueError, match="type str"):
        auth.check_secret("a string, not bytes")


def test_pooled_stream_to_a_restarted_peer_is_replaced():
    """A peer that went away and came back on the same port: the stale stream is retried once."""
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    first, second = Store(), Store()
    server = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    addr = server.start(first)
    try:
        client.push(addr, [(ChunkKey(1, "x", 0, 0), memoryview(b"one"))], timeout=10)  # pools a stream
        server.close()
        server = make_transport("tcp", secret=SECRET, host="127.0.0.1", port=addr["port"])
        server.start(second)
        client.push(addr, [(ChunkKey(1, "x", 1, 0), memoryview(b"two"))], timeout=10)
        assert list(second.held) == [ChunkKey(1, "x", 1, 0)]
        server.close()  # and now gone for good: the retry fails too, and says so
        with pytest.raises(TransportError, match="127.0.0.1"):
            client.push(addr, [(ChunkKey(1, "x", 2, 0), memoryview(b"three"))], timeout=10)
    finally:
        client.close()
        server.close()
