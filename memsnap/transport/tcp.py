"""The direct TCP transport: authenticated streams between agents, zero-copy both ways.

Server: one listening thread plus one thread per connection, blocking sockets (the GIL is
released in recv/send). Every connection first passes the HMAC handshake (auth.py); then
each pushed chunk is received with ``recv_into`` straight into the destination the chunk
store reserved, verified against its xxh3-64, and acknowledged. Client: one pooled stream
per peer and caller thread, chunks sent as ``sendall`` of memoryview slices with up to
``window`` chunks unacknowledged, so the stream never waits for a round trip.

Timeouts: every client call has a deadline; it bounds the connect and handshake, is checked
between frames, and limits how long a single send or receive may wait for the peer.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from typing import Callable, Sequence

import xxhash

from memsnap.errors import AuthenticationError, TransportError
from memsnap.transport import auth, wire
from memsnap.transport.base import ChunkKey, ChunkStore, Transport

log = logging.getLogger("memsnap.transport")

HANDSHAKE_TIMEOUT = 10.0  # seconds a server waits for a new connection to prove the secret


class _Timeout(Exception):
    pass


def _byte_view(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _arm(sock: socket.socket, deadline: float) -> None:
    """Make the next blocking send/recv on ``sock`` give up when ``deadline`` passes."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Timeout()
    tv = struct.pack("ll", int(left), max(1, int((left % 1) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _peer(peer: dict) -> tuple[str, int]:
    try:
        return str(peer["host"]), int(peer["port"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"peer address {peer!r} is not a TCP address: pass the dict start() returned") from None


class _Server:
    """Accepts authenticated connections and serves one chunk store."""

    def __init__(self, store: ChunkStore, secret: bytes, host: str, port: int):
        self.store, self.secret = store, secret
        self.listener = socket.create_server((host, port), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closing = False
        self.thread = threading.Thread(target=self._accept, name=f"memsnap-tcp-{self.port}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                             name=f"memsnap-tcp-{self.port}-{addr[1]}").start()

    def _serve(self, sock: socket.socket, addr) -> None:
        try:
            if self._authenticate(sock, addr):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self.closing:
                    self._one_request(sock)
        except (ConnectionError, OSError) as exc:
            log.debug("data-plane connection from %s:%s ended: %s", addr[0], addr[1], exc)
        except Exception:
            log.warning("data-plane connection from %s:%s failed", addr[0], addr[1], exc_info=True)
        finally:
            with self.lock:
                self.conns.discard(sock)
            sock.close()

    def _authenticate(self, sock: socket.socket, addr) -> bool:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            auth.server_handshake(sock, self.secret)
            sock.settimeout(None)
            return True
        except (AuthenticationError, OSError) as exc:
            if not self.closing:
                log.warning("dropped data-plane connection from %s:%s: authentication failed: %s",
                            addr[0], addr[1], exc or type(exc).__name__)
            return False

    def _one_request(self, sock: socket.socket) -> None:
        op, raw, nbytes, checksum = wire.read_request(sock)
        try:
            key = ChunkKey.unpack(raw)
        except ValueError as exc:
            wire.drain(sock, nbytes)
            wire.send_response(sock, wire.FAILED, f"bad key: {exc}")
            return
        if op == wire.PUSH:
            self._receive(sock, key, nbytes, checksum)
        else:
            wire.drain(sock, nbytes)  # a fetch carries no payload; skip any a bad client sent
            self._send(sock, key)

    def _receive(self, sock: socket.socket, key: ChunkKey, nbytes: int, checksum: int) -> None:
        try:
            dest = _byte_view(self.store.reserve(key, nbytes))
            if len(dest) != nbytes:
                self.store.discard(key)
                raise ValueError(f"the store reserved {len(dest)} bytes for a {nbytes}-byte chunk")
        except Exception as exc:
            wire.drain(sock, nbytes)
            wire.send_response(sock, wire.FAILED, f"{type(exc).__name__}: {exc}")
            return
        try:
            wire.recv_into(sock, dest)
        except BaseException:
            self.store.discard(key)
            raise
        if xxhash.xxh3_64_intdigest(dest) != checksum:
            self.store.discard(key)
            log.warning("chunk %s arrived with a bad checksum; dropped", key)
            wire.send_response(sock, wire.FAILED, "checksum mismatch on arrival")
            return
        self.store.complete(key, checksum)
        wire.send_response(sock, wire.OK)

    def _send(self, sock: socket.socket, key: ChunkKey) -> None:
        held = self.store.lookup(key)
        if held is None:
            wire.send_response(sock, wire.MISSING)
        else:
            wire.send_response(sock, wire.OK, payload=_byte_view(held[0]), checksum=held[1])

    def close(self) -> None:
        self.closing = True
        for s in [self.listener, *list(self.conns)]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()
        self.thread.join(timeout=5)


class TcpTransport(Transport):
    """Chunks over direct, authenticated TCP streams (see the module docstring)."""

    name = "tcp"

    def __init__(self, *, secret: bytes, host: str, port: int = 0, window: int = 32):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: must be an int >= 1 (chunks in flight per stream)")
        self.secret = auth.check_secret(secret)
        self.host, self.port, self.window = host, port, window
        self._server: _Server | None = None
        self._idle: dict[tuple[str, int], list[socket.socket]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    # -- server half ---------------------------------------------------------------------
    def start(self, store: ChunkStore) -> dict:
        if self._server is not None:
            raise RuntimeError("this transport is already started; call start() once per agent")
        self._server = _Server(store, self.secret, self.host, self.port)
        return {"transport": "tcp", "host": self.host, "port": self._server.port}

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            socks = [s for pool in self._idle.values() for s in pool]
            self._idle.clear()
        for s in socks:
            s.close()

    # -- client half ---------------------------------------------------------------------
    def push(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> None:
        if items:
            self._call(peer, items, timeout, "push", self._push_on)

    def fetch(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> list[bool]:
        if not items:
            return []
        return self._call(peer, items, timeout, "fetch", self._fetch_on)

    def _call(self, peer: dict, items, timeout: float, what: str, body: Callable):
        addr = _peer(peer)
        deadline = time.monotonic() + timeout
        cursor = [items[0][0]]
        for attempt in (0, 1):
            sock, pooled = self._checkout(addr, deadline, cursor, what)
            try:
                result = body(sock, items, deadline, cursor, addr)
            except (_Timeout, BlockingIOError, socket.timeout):
                sock.close()
                raise TransportError(f"{what} to {addr[0]}:{addr[1]} timed out after {timeout:g} s "
                                     f"at chunk {cursor[0]}") from None
            except (OSError, ValueError) as exc:
                sock.close()
                if pooled and attempt == 0 and isinstance(exc, ConnectionError):
                    continue  # a stale pooled stream (the peer restarted): retry on a fresh one
                raise TransportError(f"{what} to {addr[0]}:{addr[1]} failed at chunk {cursor[0]}: {exc}") from exc
            except BaseException:
                sock.close()
                raise
            self._checkin(addr, sock)
            return result
        raise AssertionError("unreachable")

    def _checkout(self, addr, deadline: float, cursor, what: str) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle[addr]:
                return self._idle[addr].pop(), True
        try:
            return self._connect(addr, deadline), False
        except (_Timeout, BlockingIOError, socket.timeout):
            raise TransportError(f"{what} to {addr[0]}:{addr[1]}: connecting timed out at chunk {cursor[0]}") from None
        except (OSError, AuthenticationError) as exc:
            raise TransportError(f"{what} to {addr[0]}:{addr[1]}: cannot connect for chunk {cursor[0]}: {exc}") from exc

    def _connect(self, addr, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        sock = socket.create_connection(addr, timeout=left)
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _arm(sock, deadline)
            auth.client_handshake(sock, self.secret)
            return sock
        except BaseException:
            sock.close()
            raise

    def _checkin(self, addr, sock: socket.socket) -> None:
        with self._lock:
            self._idle[addr].append(sock)

    def _push_on(self, sock, items, deadline: float, cursor, addr) -> None:
        pending: collections.deque[ChunkKey] = collections.deque()
        for key, buf in items:
            cursor[0] = key
            view = _byte_view(buf)
            _arm(sock, deadline)
            wire.send_request(sock, wire.PUSH, key.pack(), view, xxhash.xxh3_64_intdigest(view))
            pending.append(key)
            if len(pending) >= self.window:
                self._ack(sock, pending.popleft(), deadline, cursor, addr)
        while pending:
            self._ack(sock, pending.popleft(), deadline, cursor, addr)

    def _ack(self, sock, key: ChunkKey, deadline: float, cursor, addr) -> None:
        cursor[0] = key
        _arm(sock, deadline)
        status, message, _, _ = wire.read_response(sock)
        if status != wire.OK:
            sock.close()
            raise TransportError(f"push to {addr[0]}:{addr[1]}: the peer refused chunk {key}: {message}")

    def _fetch_on(self, sock, items, deadline: float, cursor, addr) -> list[bool]:
        for key, _ in items[:self.window]:
            _arm(sock, deadline)
            wire.send_request(sock, wire.FETCH, key.pack(), None, 0)
        found = []
        for i, (key, buf) in enumerate(items):
            cursor[0] = key
            found.append(self._receive_one(sock, key, _byte_view(buf), deadline, addr))
            if i + self.window < len(items):
                _arm(sock, deadline)
                wire.send_request(sock, wire.FETCH, items[i + self.window][0].pack(), None, 0)
        return found

    def _receive_one(self, sock, key: ChunkKey, dest: memoryview, deadline: float, addr) -> bool:
        _arm(sock, deadline)
        status, message, nbytes, checksum = wire.read_response(sock)
        if status != wire.OK:
            if status == wire.FAILED:
                log.warning("fetch from %s:%s: chunk %s failed: %s", addr[0], addr[1], key, message)
            return False
        if nbytes != len(dest):
            wire.drain(sock, nbytes)
            log.warning("fetch from %s:%s: chunk %s is %d bytes, the buffer %d", addr[0], addr[1], key,
                        nbytes, len(dest))
            return False
        wire.recv_into(sock, dest)
        if xxhash.xxh3_64_intdigest(dest) != checksum:
            log.warning("fetch from %s:%s: chunk %s fails its checksum; treated as missing", addr[0], addr[1], key)
            return False
        return True
