"""The direct TCP transport's client and the ``Transport`` it makes with server.py's half.

Every connection passes the handshake (auth.py) and then carries only authenticated frames
(wire.py, session.py): each frame has a sequence number and tags under per-connection,
per-direction keys, so a frame injected, replayed, reordered, truncated or modified on the
path is rejected and the connection closed; ``wire="encrypt"`` also encrypts the payloads.
Client: one pooled stream per peer and caller thread, chunks sent as memoryview slices with
up to ``window`` chunks unacknowledged, so the stream never waits for a round trip. A pushed
chunk is tagged a slice at a time just before the socket copies that slice (wire.py), so the
MAC reads it from cache and the copy does not read it from memory again; the holder computes
the checksum it stores (xxh3-64) as it checks the tag. Fetched chunks land with ``recv_into``
straight in the caller's buffers and are checked as they land (tag, and the xxh3-64 the
holder stored).

Timeouts: a client call has one deadline; it bounds the connect, the handshake and every
frame whole (each system call waits only for what is left of it).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from memsnap.config import tunable
from memsnap.errors import AuthenticationError, PushCancelled, StepGivenUp, TransportError
from memsnap.transport import auth, wire
from memsnap.transport.base import (
    ChunkKey,
    ChunkStore,
    Transport,
    byte_view,
    dest_parts,
)
from memsnap.transport.server import Server
from memsnap.transport.session import AESGCM, MODES, FrameError

log = logging.getLogger("memsnap.transport")

_TIMEOUTS = (wire.FrameTimeout, BlockingIOError, socket.timeout)


def _peer(peer: dict) -> tuple[str, int]:
    try:
        return str(peer["host"]), int(peer["port"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"peer address {peer!r} is not a TCP address: pass the dict start() returned") from None


def _wire_mode(wire_mode: str | None) -> str:
    mode = wire_mode or ("encrypt" if tunable("tcp_encrypt") else "mac")
    if mode not in MODES:
        raise ValueError(f"wire={wire_mode!r}: use 'mac' (authenticated frames) or 'encrypt' (also encrypted)")
    if mode == "encrypt" and not hasattr(AESGCM, "decrypt_into"):
        raise ValueError(
            "wire='encrypt' needs cryptography >= 45 (AESGCM.encrypt_into, decrypt_into): "
            "pip install 'cryptography>=45'"
        )
    return mode


class _Conn:
    """A client's authenticated stream: the socket, its session and scratch buffers."""

    __slots__ = ("scratch", "session", "sock")

    def __init__(self, sock: socket.socket, session):
        self.sock, self.session, self.scratch = sock, session, wire.Scratch()

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    """Chunks over direct, authenticated TCP streams (see the module docstring).

    ``wire``: "mac" (every frame authenticated) or "encrypt" (also encrypted, AES-256-GCM);
    None reads the ``tcp_encrypt`` tunable. Every agent of a job must use the same.
    ``max_chunk``: the largest chunk a peer may send (a bigger frame closes the connection);
    None reads the ``tcp_max_frame_bytes`` tunable. Pass the job's chunk size.
    """

    name = "tcp"

    def __init__(
        self,
        *,
        secret: bytes,
        host: str,
        port: int = 0,
        window: int = 32,
        wire: str | None = None,
        max_chunk: int | None = None,
    ):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: must be an int >= 1 (chunks in flight per stream)")
        if max_chunk is not None and (not isinstance(max_chunk, int) or max_chunk < 1):
            raise ValueError(f"max_chunk={max_chunk!r}: must be a positive int (bytes) or None")
        self.secret = auth.check_secret(secret)
        self.host, self.port, self.window = host, port, window
        self.mode = _wire_mode(wire)
        self.max_chunk = max_chunk or int(tunable("tcp_max_frame_bytes"))
        self._server: Server | None = None
        self._idle: dict[tuple[str, int], list[_Conn]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    # -- server half ---------------------------------------------------------------------
    def start(self, store: ChunkStore) -> dict:
        if self._server is not None:
            raise RuntimeError("this transport is already started; call start() once per agent")
        self._server = Server(store, self.secret, self.host, self.port, self.mode, self.max_chunk)
        return {"transport": "tcp", "host": self.host, "port": self._server.port}

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            conns = [c for pool in self._idle.values() for c in pool]
            self._idle.clear()
        for c in conns:
            c.close()

    # -- client half ---------------------------------------------------------------------
    def push(
        self,
        peer: dict,
        items: Sequence[tuple[ChunkKey, memoryview]],
        *,
        timeout: float,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        if items:

            def body(conn: _Conn, items, deadline: float, cursor, addr) -> None:
                self._push_on(conn, items, deadline, cursor, addr, cancel)

            self._call(peer, items, timeout, "push", body)

    def fetch(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> list[bool]:
        if not items:
            return []
        return self._call(peer, items, timeout, "fetch", self._fetch_on)

    def _call(self, peer: dict, items, timeout: float, what: str, body: Callable):
        addr = _peer(peer)
        deadline = time.monotonic() + timeout
        cursor = [items[0][0]]
        for attempt in (0, 1):
            conn, pooled = self._checkout(addr, deadline, cursor, what)
            try:
                result = body(conn, items, deadline, cursor, addr)
            except _TIMEOUTS:
                conn.close()
                raise TransportError(
                    f"{what} to {addr[0]}:{addr[1]} timed out after {timeout:g} s at chunk {cursor[0]}"
                ) from None
            except (OSError, ValueError, FrameError) as exc:
                conn.close()
                if pooled and attempt == 0 and isinstance(exc, ConnectionError):
                    continue  # a stale pooled stream (the peer restarted or closed it idle): retry on a fresh one
                raise TransportError(f"{what} to {addr[0]}:{addr[1]} failed at chunk {cursor[0]}: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            self._checkin(addr, conn)
            return result
        raise AssertionError("unreachable")

    def _checkout(self, addr, deadline: float, cursor, what: str) -> tuple[_Conn, bool]:
        with self._lock:
            if self._idle[addr]:
                return self._idle[addr].pop(), True
        try:
            return self._connect(addr, deadline), False
        except _TIMEOUTS:
            raise TransportError(f"{what} to {addr[0]}:{addr[1]}: connecting timed out at chunk {cursor[0]}") from None
        except (OSError, AuthenticationError) as exc:
            raise TransportError(f"{what} to {addr[0]}:{addr[1]}: cannot connect for chunk {cursor[0]}: {exc}") from exc

    def _connect(self, addr, deadline: float) -> _Conn:
        left = deadline - time.monotonic()
        if left <= 0:
            raise wire.FrameTimeout("no time left to connect")
        sock = socket.create_connection(addr, timeout=left)
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _Conn(sock, auth.client_handshake(sock, self.secret, deadline, self.mode))
        except BaseException:
            sock.close()
            raise

    def _checkin(self, addr, conn: _Conn) -> None:
        with self._lock:
            self._idle[addr].append(conn)

    def _push_on(self, conn: _Conn, items, deadline: float, cursor, addr, cancel) -> None:
        """(A push called off leaves acknowledgements unread: ``_call`` closes the stream.)"""
        pending: collections.deque[ChunkKey] = collections.deque()
        for key, buf in items:
            cursor[0] = key
            if cancel is not None and cancel():
                raise PushCancelled(f"push to {addr[0]}:{addr[1]} called off at chunk {key}")
            wire.send_frame(
                conn.sock, conn.session.send, wire.PUSH, key.pack(), byte_view(buf), 0, deadline, conn.scratch
            )
            pending.append(key)
            if len(pending) >= self.window:
                self._ack(conn, pending.popleft(), deadline, cursor, addr)
        while pending:
            self._ack(conn, pending.popleft(), deadline, cursor, addr)

    def _ack(self, conn: _Conn, key: ChunkKey, deadline: float, cursor, addr) -> None:
        cursor[0] = key
        head = wire.read_head(conn.sock, conn.session.recv, wire.RESPONSES, 0, deadline)
        if head.kind != wire.OK:
            conn.close()
            error = StepGivenUp if head.kind == wire.GIVEN_UP else TransportError
            raise error(
                f"push to {addr[0]}:{addr[1]}: the peer refused chunk {key}: {head.name.decode(errors='replace')}"
            )

    # -- fetch -----------------------------------------------------------------------------
    def _fetch_on(self, conn: _Conn, items, deadline: float, cursor, addr) -> list[bool]:
        for key, _ in items[: self.window]:
            wire.send_frame(conn.sock, conn.session.send, wire.FETCH, key.pack(), None, 0, deadline)
        found: list[bool] = []
        for i, (key, buf) in enumerate(items):
            cursor[0] = key
            found.append(self._receive_one(conn, key, dest_parts(buf), deadline, addr))
            if i + self.window < len(items):
                wire.send_frame(
                    conn.sock, conn.session.send, wire.FETCH, items[i + self.window][0].pack(), None, 0, deadline
                )
        return found

    def _receive_one(self, conn: _Conn, key: ChunkKey, dest: list[memoryview], deadline: float, addr) -> bool:
        """Read one fetch answer into the views ``dest``: whether the chunk is there and matches
        the checksum the holder stored (FrameError when the frame was tampered with)."""
        d = conn.session.recv
        head = wire.read_head(conn.sock, d, wire.RESPONSES, self.max_chunk, deadline)
        if head.kind != wire.OK:
            if head.kind == wire.FAILED:
                log.warning(
                    "fetch from %s:%s: chunk %s failed: %s", addr[0], addr[1], key, head.name.decode(errors="replace")
                )
            return False
        size = sum(len(p) for p in dest)
        if head.nbytes != size:
            wire.drain(conn.sock, head.nbytes, deadline)  # (and its tag)
            log.warning(
                "fetch from %s:%s: chunk %s is %d bytes, the buffer %d", addr[0], addr[1], key, head.nbytes, size
            )
            return False
        if wire.read_body(conn.sock, d, head, dest, conn.scratch, True) == head.checksum:
            return True
        log.warning(
            "fetch from %s:%s: chunk %s fails its checksum (the held copy is corrupt); treated as missing",
            addr[0],
            addr[1],
            key,
        )
        return False
