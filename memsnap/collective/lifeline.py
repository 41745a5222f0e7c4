"""Lifelines: one TCP connection from each member's process to its controller, held open for as
long as the process lives, so that a process that dies is noticed in milliseconds.

When a process ends for any reason (killed, crashed, its node's raylet taking its workers down)
its kernel closes its sockets, and the controller's end reads the close at once. Heartbeats
(``heartbeat.py``) need ``lost_after_s`` of silence to say the same, and stay the signal for a
host that vanishes without closing anything (power lost, network cut). A member that leaves on
purpose says ``bye`` first, so its close is not a loss.

A closed lifeline alone does not make a member lost: a connection can break while its process
lives (a network blip). The controller also wants the member's beats to have stopped
(``InplaceJob``: no beat for two beat periods), which a live process keeps up.

Wire layout (this module is both ends): the member sends one line of JSON,
``{"member": <name>, "nonce": <hex>}\\n`` (at most 1 KiB), and later ``bye\\n`` or nothing.
The nonce is the one the controller gave that member when it started it (through Ray), so a
stranger cannot hold, or close, another member's lifeline. The controller never writes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
import weakref

log = logging.getLogger("memsnap.inplace")

HELLO_MAX = 1024  # bytes of a hello line; a longer one is dropped
BYE = b"bye\n"


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.opened = time.monotonic()
        self.buf = b""
        self.member: str | None = None  # once its hello named a member with the right nonce
        self.bye = False


class Lifelines:
    """The controller's end: a listening socket on ``host`` and a thread that watches every
    member's connection. ``expect(member)`` before starting the member; ``gone()`` names those
    whose connection closed without ``bye``, with when."""

    def __init__(self, host: str, *, hello_timeout_s: float = 10.0, max_pending: int = 64):
        self._listen = socket.create_server((host, 0))
        self._listen.setblocking(False)
        self.address: tuple[str, int] = (host, self._listen.getsockname()[1])
        self.hello_timeout_s, self.max_pending = float(hello_timeout_s), int(max_pending)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._nonces: dict[str, str] = {}  # member -> the nonce it must show
        self._held: dict[str, _Conn] = {}  # member -> its current connection
        self._gone: dict[str, float] = {}  # member -> time.time() its lifeline closed without bye
        self.left: set[str] = set()  # members that said bye
        self._pending: set[_Conn] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memsnap-lifelines", daemon=True)
        self._thread.start()

    def expect(self, member: str) -> tuple[str, int, str]:
        """Accept a lifeline from ``member``: the (host, port, nonce) to give it."""
        nonce = secrets.token_hex(16)
        with self._lock:
            self._nonces[member] = nonce
            self._gone.pop(member, None)
            self.left.discard(member)
        return (*self.address, nonce)

    def forget(self, member: str) -> None:
        """Stop watching ``member`` (it left the job, or was declared lost)."""
        with self._lock:
            self._nonces.pop(member, None)
            self._gone.pop(member, None)
            conn = self._held.pop(member, None)
        if conn is not None:
            conn.member = None  # its close, when it comes, names nobody

    def gone(self) -> dict[str, float]:
        """``{member: when its lifeline closed without bye}`` (wall clock) for watched members."""
        with self._lock:
            return dict(self._gone)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()

    # --- the watching thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            self._drop_stale()

    def _accept(self) -> None:
        try:
            sock, _ = self._listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._pending) >= self.max_pending:
            # a flood of connections that do not say who they are: the oldest goes, so that a
            # member, which says who it is as it connects, still gets through
            self._drop(min(self._pending, key=lambda c: c.opened))
        sock.setblocking(False)
        conn = _Conn(sock)
        self._pending.add(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset: closed as surely as by a FIN
        if not data:
            self._closed(conn)
            return
        if conn.member is None and conn in self._pending:
            conn.buf += data
            if b"\n" in conn.buf:
                self._hello(conn, conn.buf.split(b"\n", 1))
            elif len(conn.buf) > HELLO_MAX:
                self._drop(conn)
            return
        if BYE.strip() in data:
            conn.bye = True

    def _hello(self, conn: _Conn, parts: list[bytes]) -> None:
        line, rest = parts
        self._pending.discard(conn)
        try:
            hello = json.loads(line)
            member, nonce = str(hello["member"]), str(hello["nonce"])
        except (ValueError, KeyError, TypeError):
            self._drop(conn)
            return
        with self._lock:
            expected = self._nonces.get(member)
            if expected is None or not secrets.compare_digest(expected, nonce):
                ok = False
            else:
                ok = True
                old = self._held.get(member)
                if old is not None:
                    old.member = None  # replaced: the old connection's close names nobody
                self._held[member] = conn
        if not ok:
            log.warning("lifeline from %r refused: not a member this controller started", member)
            self._drop(conn)
            return
        conn.member, conn.buf = member, b""
        if BYE.strip() in rest:
            conn.bye = True

    def _closed(self, conn: _Conn) -> None:
        member = conn.member
        self._drop(conn)
        if member is None:
            return
        with self._lock:
            if self._held.get(member) is not conn:
                return
            del self._held[member]
            if conn.bye:
                self.left.add(member)
            elif member in self._nonces:
                self._gone[member] = time.time()

    def _drop(self, conn: _Conn) -> None:
        self._pending.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._pending if now - c.opened > self.hello_timeout_s]:
            self._drop(conn)


_HELD: weakref.WeakSet = weakref.WeakSet()  # this process's lifelines, closed in a forked child


def _close_in_child() -> None:
    """In a child forked from a member (a data loader's workers, ``multiprocessing``'s fork):
    its copies of the member's lifelines are closed, so that the member's own death closes
    them. A child that kept one open would hide that death until the child ended too (a
    loader's worker notices its parent's death only seconds later)."""
    for line in list(_HELD):
        line._sock.close()  # (the child's copy of the descriptor: the parent's stays open)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class Lifeline:
    """A member's end: connect, say who it is, hold the connection; ``close`` says bye. A
    process forked from the member does not hold it (``_close_in_child``)."""

    def __init__(self, member: str, ticket: tuple[str, int, str], timeout_s: float = 10.0):
        host, port, nonce = ticket  # what ``Lifelines.expect(member)`` gave
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.sendall(json.dumps({"member": member, "nonce": nonce}).encode() + b"\n")
        _HELD.add(self)

    def close(self) -> None:
        try:
            self._sock.sendall(BYE)
        except OSError:
            pass  # the controller is gone: nobody to tell
        finally:
            self._sock.close()
