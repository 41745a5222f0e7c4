"""The TCP data plane's server half: an accept loop that never dies, bounded handshakes, one
authenticated stream per connection that stores pushed chunks and answers fetches.

Limits (config.py TUNABLES, ``MEMSNAP_<NAME>`` overrides): at most ``tcp_max_unauthenticated``
connections in their handshake, at most ``tcp_max_unauthenticated_per_source`` of them from one
source address, each with one deadline for the whole handshake (``tcp_handshake_timeout_s``). A
newcomer is never refused for want of room: it evicts the oldest connection of its own address
when that address is at its quota, else, when the pool is full, the oldest of the address holding
the most (``Admission``), so silent connections cannot lock new peers out. An authenticated
connection is closed after ``tcp_idle_timeout_s`` without a new request, and when a frame does
not arrive or leave whole within ``tcp_frame_timeout_s`` (a chunk being received is discarded,
so its reservation is released). A frame larger than the chunk bound, a malformed key, or a
frame failing its tag closes the connection. Refused and evicted connections are logged as one
line per ``tcp_refusal_log_s`` with a count.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

from memsnap.config import tunable
from memsnap.errors import AuthenticationError, ConfigError, StepGivenUp
from memsnap.transport import auth, wire
from memsnap.transport.base import ChunkKey, ChunkStore, byte_view
from memsnap.transport.session import FrameError, Session

log = logging.getLogger("memsnap.transport")

PIPELINE = 8  # requests read (pushes: checked) ahead of the one being answered, per connection
# accept(2): errors of the one connection, to retry at once, and a shortage of resources, to retry after a pause
_RETRY_NOW = {
    errno.ECONNABORTED,
    errno.EINTR,
    errno.EPROTO,
    errno.EAGAIN,
    errno.ENETDOWN,
    errno.ENOPROTOOPT,
    errno.EHOSTDOWN,
    errno.ENONET,
    errno.EHOSTUNREACH,
    errno.EOPNOTSUPP,
    errno.ENETUNREACH,
    errno.EPERM,
    errno.ETIMEDOUT,
}
_SHORTAGE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class Limits:
    """The server's deadlines and bounds, read from the tunables when it starts."""

    handshake_s: float
    max_unauthenticated: int
    max_per_source: int
    idle_s: float
    frame_s: float
    max_payload: int
    backoff_s: float
    log_every_s: float

    @classmethod
    def from_tunables(cls, max_payload: int) -> Limits:
        return cls(
            tunable("tcp_handshake_timeout_s"),
            _at_least_one("tcp_max_unauthenticated"),
            _at_least_one("tcp_max_unauthenticated_per_source"),
            tunable("tcp_idle_timeout_s"),
            tunable("tcp_frame_timeout_s"),
            max_payload,
            tunable("tcp_accept_backoff_s"),
            tunable("tcp_refusal_log_s"),
        )


def _at_least_one(name: str) -> int:
    value = int(tunable(name))
    if value < 1:
        raise ConfigError(f"MEMSNAP_{name.upper()}={value}: must be at least 1 (connections)")
    return value


def source_of(addr) -> str:
    """The source a connection counts against in the handshake pool (``Admission``): its peer's
    IP address, without the port."""
    return addr[0]


class Admission:
    """The pool of connections still in their handshake, by source address and age: decides
    whom a newcomer evicts. A newcomer is always admitted; it evicts the oldest connection of
    its own address when that address holds more than ``per_source``, else, when the pool holds
    more than ``size``, the oldest connection of the address holding the most (ties: the oldest
    of those). One address thus never holds more than its quota, and a connection is evicted
    only for a newcomer from its own address, or from anywhere once its address holds the
    most, and only after its address's older ones: a peer that sends its hello promptly gets
    in unless its own address floods the pool faster than that hello arrives."""

    def __init__(self, size: int, per_source: int):
        self.size, self.per_source = size, per_source
        self.sources: dict[object, dict[object, int]] = {}  # address -> {connection: arrival}, oldest first
        self.source_of: dict[object, object] = {}
        self.arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.source_of)

    def count(self, source) -> int:
        return len(self.sources.get(source, ()))

    def admit(self, conn, source):
        """Add ``conn`` from ``source``; the connection it evicts (out of the pool now), or None."""
        self.sources.setdefault(source, {})[conn] = next(self.arrivals)
        self.source_of[conn] = source
        if self.count(source) > self.per_source:
            victim = next(iter(self.sources[source]))
        elif len(self) > self.size:
            victim = next(iter(self.sources[self._heaviest()]))
        else:
            return None
        self.leave(victim)
        return victim

    def _heaviest(self):
        """The address holding the most connections; of those, the one with the oldest."""
        return max(self.sources, key=lambda s: (len(self.sources[s]), -next(iter(self.sources[s].values()))))

    def leave(self, conn) -> bool:
        """Take ``conn`` out of the pool (its handshake ended); False if it was not in it (evicted)."""
        source = self.source_of.pop(conn, None)
        if source is None:
            return False
        held = self.sources[source]
        del held[conn]
        if not held:
            del self.sources[source]
        return True


class RateLog:
    """Warnings about refused connections, at most one line per interval, with a count."""

    def __init__(self, interval: float):
        self.interval, self.lock = interval, threading.Lock()
        self.count, self.next_at = 0, 0.0

    def note(self, message: str, *args) -> None:
        with self.lock:
            self.count += 1
            now = time.monotonic()
            if now < self.next_at:
                return
            count, self.count, self.next_at = self.count, 0, now + self.interval
        more = f" ({count - 1} more refused since the last line)" if count > 1 else ""
        log.warning(message + more, *args)

    def flush(self) -> None:
        with self.lock:
            count, self.count = self.count, 0
        if count:
            log.warning("%d more data-plane connections were refused", count)


class Server:
    """Accepts authenticated connections and serves one chunk store."""

    def __init__(self, store: ChunkStore, secret: bytes, host: str, port: int, mode: str, max_payload: int):
        self.store, self.secret, self.mode = store, secret, mode
        self.limits = Limits.from_tunables(max_payload)
        self.refusals = RateLog(self.limits.log_every_s)
        self.listener = socket.create_server((host, port), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.conns: set[socket.socket] = set()
        self.pool = Admission(self.limits.max_unauthenticated, self.limits.max_per_source)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._accept, name=f"memsnap-tcp-{self.port}", daemon=True)
        self.thread.start()

    # -- accepting ---------------------------------------------------------------------------
    def _accept(self) -> None:
        """Accept until closed; a failing accept() is retried, never the end of the loop."""
        pause = 0.0
        while not self.stopping.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError as exc:
                pause = self._accept_failed(exc, pause)
                continue
            pause = 0.0
            self._admit(sock, addr)

    def _accept_failed(self, exc: OSError, pause: float) -> float:
        """Wait before the next accept() as ``exc`` calls for; return the next pause."""
        if self.stopping.is_set() or exc.errno in _RETRY_NOW:
            return pause
        self.refusals.note("data-plane accept() failed: %s; retrying", exc)
        pause = min(max(2 * pause, 0.01), self.limits.backoff_s)
        self.stopping.wait(pause if exc.errno in _SHORTAGE else self.limits.backoff_s)
        return pause

    def _admit(self, sock: socket.socket, addr) -> None:
        """Serve ``sock`` on its own thread, evicting whom the pool says (its thread then ends)."""
        with self.lock:
            victim = self.pool.admit(sock, source_of(addr))
            self.conns.add(sock)
        if victim is not None:
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)  # wakes its handshake, which then gives up
            self.refusals.note(
                "evicted the oldest data-plane connection still in its handshake for one "
                "from %s:%s (tcp_max_unauthenticated=%d, tcp_max_unauthenticated_per_source=%d)",
                addr[0],
                addr[1],
                self.limits.max_unauthenticated,
                self.limits.max_per_source,
            )
        threading.Thread(
            target=self._serve, args=(sock, addr), daemon=True, name=f"memsnap-tcp-{self.port}-{addr[1]}"
        ).start()

    # -- one connection ----------------------------------------------------------------------
    def _serve(self, sock: socket.socket, addr) -> None:
        try:
            session = self._authenticate(sock, addr)
            if session is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                Stream(self, sock, session).run()
        except FrameError as exc:
            if not self.stopping.is_set():
                self.refusals.note("closed data-plane connection from %s:%s: %s", addr[0], addr[1], exc)
        except (ConnectionError, OSError) as exc:
            log.debug("data-plane connection from %s:%s ended: %s", addr[0], addr[1], exc)
        except Exception:
            log.warning("data-plane connection from %s:%s failed", addr[0], addr[1], exc_info=True)
        finally:
            with self.lock:
                self.conns.discard(sock)
            sock.close()

    def _authenticate(self, sock: socket.socket, addr) -> Session | None:
        """The session of ``sock``'s handshake; None if it failed or the connection was evicted."""
        session = failure = None
        try:
            session = auth.server_handshake(sock, self.secret, time.monotonic() + self.limits.handshake_s, self.mode)
        except (AuthenticationError, OSError) as exc:
            failure = exc
        finally:
            with self.lock:
                evicted = not self.pool.leave(sock)
        if failure is not None and not evicted and not self.stopping.is_set():
            self.refusals.note(
                "dropped data-plane connection from %s:%s: authentication failed: %s",
                addr[0],
                addr[1],
                failure or type(failure).__name__,
            )
        return None if evicted else session

    def close(self) -> None:
        self.stopping.set()
        with self.lock:
            socks = [self.listener, *self.conns]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=5)
        self.refusals.flush()


class Stream:
    """One authenticated connection: a reader receiving requests straight into the store's
    buffers, checking each pushed chunk's tag and computing the xxh3-64 stored with it as the
    bytes land, and a responder that stores the chunk and answers, in order, while the reader
    already receives the next one."""

    def __init__(self, server: Server, sock: socket.socket, session: Session):
        self.server, self.store, self.limits = server, server.store, server.limits
        self.sock, self.session = sock, session
        self.rscratch, self.wscratch = wire.Scratch(), wire.Scratch()

    def run(self) -> None:
        jobs: queue.Queue = queue.Queue(maxsize=PIPELINE)
        responder = threading.Thread(target=self._respond, args=(jobs,), daemon=True)
        responder.start()
        try:
            while not self.server.stopping.is_set():
                jobs.put(self._read_one())
        finally:
            jobs.put(None)
            responder.join()

    def _read_one(self) -> tuple:
        """The next request as a job for the responder; raises to close the connection."""
        idle = time.monotonic() + self.limits.idle_s
        head = wire.read_head(
            self.sock, self.session.recv, wire.REQUESTS, self.limits.max_payload, idle, self.limits.frame_s
        )
        try:
            key = ChunkKey.unpack(head.name)
        except ValueError as exc:
            raise FrameError(f"bad chunk key: {exc}") from None
        if head.kind == wire.FETCH:
            if head.nbytes:
                raise FrameError(f"a fetch of {key} carries {head.nbytes} bytes of payload")
            return ("fetch", key)
        try:
            dest = self._reserve(key, head.nbytes)
        except Exception as exc:
            wire.drain(self.sock, head.nbytes, head.deadline)
            status = wire.GIVEN_UP if isinstance(exc, StepGivenUp) else wire.FAILED
            return ("fail", status, f"{type(exc).__name__}: {exc}")
        try:
            checksum = wire.read_body(self.sock, self.session.recv, head, [dest], self.rscratch, True)
        except BaseException:
            self.store.discard(key)
            raise
        return ("push", key, checksum)

    def _reserve(self, key: ChunkKey, nbytes: int) -> memoryview:
        dest = byte_view(self.store.reserve(key, nbytes))
        if len(dest) != nbytes:
            self.store.discard(key)
            raise ValueError(f"the store reserved {len(dest)} bytes for a {nbytes}-byte chunk")
        return dest

    def _respond(self, jobs: queue.Queue) -> None:
        """Answer every job in order; after a failure, discard the rest and stop answering."""
        broken = False
        while (job := jobs.get()) is not None:
            if broken:
                self._drop(job)
                continue
            try:
                status, message, payload, checksum = self._answer(job)
                wire.send_frame(
                    self.sock,
                    self.session.send,
                    status,
                    message.encode()[:0xFFFF],
                    payload,
                    checksum,
                    time.monotonic() + self.limits.frame_s,
                    self.wscratch,
                )
            except Exception as exc:
                if isinstance(exc, FrameError):
                    self.server.refusals.note("closed a data-plane connection: %s", exc)
                elif not isinstance(exc, OSError):
                    log.warning("data-plane responder failed on %s", job[:2], exc_info=True)
                broken = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader

    def _drop(self, job: tuple) -> None:
        if job[0] == "push":
            self.store.discard(job[1])

    def _answer(self, job: tuple) -> tuple:
        """``(status, message, payload, checksum)`` for one job, storing a pushed chunk."""
        if job[0] == "fail":
            return job[1], job[2], None, 0
        if job[0] == "fetch":
            held = self.store.lookup(job[1])
            return (wire.MISSING, "", None, 0) if held is None else (wire.OK, "", byte_view(held[0]), held[1])
        self.store.complete(job[1], job[2])
        return wire.OK, "", None, 0
