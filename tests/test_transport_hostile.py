"""The TCP data plane against hostile and flaky peers: resource exhaustion, slow and vanishing
peers, malformed frames, and a man in the middle that modifies, replays, injects or truncates."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import cast

import pytest
import xxhash
from support.sockets import Collect

from memsnap.errors import ConfigError, TransportError
from memsnap.localcluster import wait_for
from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import HeldChunks
from memsnap.transport import ChunkKey, auth, make_transport, wire
from memsnap.transport.server import Admission

SECRET = os.urandom(32)
HELLO = len(auth.MAGIC) + 1 + auth.NONCE + auth.MAC  # the client's handshake bytes


@pytest.fixture
def served(monkeypatch):
    """``serve(**env)`` -> (store, budget, addr): a TCP server over a HeldChunks, with tunables set."""
    started = []

    def serve(max_chunk=None, wire_mode=None, step_window=None, **env):
        for name, value in env.items():
            monkeypatch.setenv("MEMSNAP_" + name.upper(), str(value))
        budget = MemoryBudget(64 << 20)
        store = HeldChunks(budget, step_window=step_window)
        t = make_transport("tcp", secret=SECRET, host="127.0.0.1", max_chunk=max_chunk, wire=wire_mode)
        started.append(t)
        return store, budget, t.start(store)

    yield serve
    for t in started:
        t.close()


def _client(**opts):
    return make_transport("tcp", secret=SECRET, host="127.0.0.1", **opts)


def _push(addr, items, timeout=10, **opts) -> None:
    client = _client(**opts)
    try:
        client.push(addr, items, timeout=timeout)
    finally:
        client.close()


def _authed(addr, mode="mac"):
    """A raw socket through the handshake, and its session (to forge frames with)."""
    sock = socket.create_connection((addr["host"], addr["port"]), timeout=10)
    return sock, auth.client_handshake(sock, SECRET, time.monotonic() + 10, mode)


def _closed_by_peer(sock: socket.socket, guard: float = 10.0) -> bool:
    """Read until the peer closes ``sock``; False if it is still open after ``guard`` seconds."""
    sock.settimeout(guard)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def _key(step=1, stripe=0, owner="peer") -> ChunkKey:
    return ChunkKey(step, owner, stripe, 0)


# --- resources -------------------------------------------------------------------------------
ATTACKER = """
import socket, sys
sys.stdin.readline()
socks = []
for _ in range(int(sys.argv[2])):
    try:
        socks.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5))
    except OSError:
        break
print(len(socks), flush=True)
sys.stdin.readline()
"""


def test_accept_loop_survives_running_out_of_descriptors(served, caplog):
    store, _, addr = served(
        tcp_max_unauthenticated=1000,
        tcp_max_unauthenticated_per_source=1000,
        tcp_accept_backoff_s=0.2,
        tcp_handshake_timeout_s=30,
    )
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER, str(addr["port"]), "80"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        assert int(attacker.stdout.readline()) == 80  # 80 idle connections, more than the server can hold
        wait_for(
            lambda: any("Too many open files" in r.getMessage() for r in caplog.records),
            timeout=20,
            what="the server to run out of descriptors",
        )
        attacker.kill()
        attacker.wait(timeout=10)
        wait_for(lambda: _push_succeeds(addr), timeout=30, what="a legitimate push after the attack")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        attacker.kill()
        attacker.wait(timeout=10)
    assert store.keys() == [_key()]


def _push_succeeds(addr) -> bool:
    try:
        _push(addr, [(_key(), memoryview(b"legit"))], timeout=5)
        return True
    except TransportError:
        return False


def _still_open(sock: socket.socket) -> bool:
    """Whether ``sock`` is open with nothing to read (the peer has neither closed it nor sent more)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def test_a_newcomer_to_a_full_handshake_pool_evicts_the_oldest(served):
    store, _, addr = served(tcp_max_unauthenticated=2, tcp_handshake_timeout_s=30)
    idle = [socket.create_connection((addr["host"], addr["port"]), timeout=10) for _ in range(2)]
    try:
        for s in idle:  # both admitted: the server greets them, and the pool is full
            assert wire.recv_exact(s, len(auth.MAGIC), time.monotonic() + 10) == auth.MAGIC
        _push(addr, [(_key(), memoryview(b"legit"))], timeout=10)
        assert _closed_by_peer(idle[0])  # the oldest made room
        assert _still_open(idle[1])
    finally:
        for s in idle:
            s.close()
    assert store.keys() == [_key()]


class SilentFlood:
    """An attacker without the secret: keeps ``per_source`` connections open for each of the
    ``sources`` that send nothing, and re-opens each one the server closes. Every connection is
    from 127.0.0.1; ``labels`` maps each open one's local port to its source, for the server's
    ``source_of`` (patched by the test) to tell the sources apart. Bounded: it opens at most
    ``budget`` connections and stops after ``limit`` seconds, or at ``stop()``."""

    def __init__(
        self,
        port: int,
        sources: list[str],
        per_source: int,
        labels: dict[int, str],
        budget: int = 2000,
        limit: float = 60,
    ):
        self.port, self.budget, self.limit, self.labels = port, budget, limit, labels
        self.wanted = [src for src in sources for _ in range(per_source)]
        self.lock, self.opened, self.reopened = threading.Lock(), 0, 0
        self.live: dict[socket.socket, bool] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def greeted(self) -> int:
        """Connections open now that the server admitted (it sent them its greeting)."""
        with self.lock:
            return sum(self.live.values())

    def _open(self, sel: selectors.BaseSelector, source: str) -> None:
        if self.opened >= self.budget:
            return
        self.opened += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            self.labels[port] = source  # before the server can accept it
            sock.settimeout(5)
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            self.labels.pop(sock.getsockname()[1], None)
            sock.close()
            return
        with self.lock:
            self.live[sock] = False
        sel.register(sock, selectors.EVENT_READ, source)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for source in self.wanted:
            self._open(sel, source)
        end = time.monotonic() + self.limit
        while not self.stopping.is_set() and time.monotonic() < end:
            for key, _ in sel.select(timeout=0.05):
                sock = cast(socket.socket, key.fileobj)  # _open registers sockets only
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                with self.lock:
                    if data:
                        self.live[sock] = True
                        continue
                    del self.live[sock]
                sel.unregister(sock)
                self.labels.pop(sock.getsockname()[1], None)  # before its port can be reused
                sock.close()
                self.reopened += 1
                self._open(sel, key.data)
        sel.close()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        with self.lock:
            for sock in self.live:
                self.labels.pop(sock.getsockname()[1], None)
                sock.close()
            self.live.clear()


def test_silent_connections_reopened_as_they_close_do_not_lock_new_peers_out(served, monkeypatch) -> None:
    """The pool full of silent connections from two other sources, each re-opened as the
    server closes it: a fresh client still pushes, and another fetches."""
    from memsnap.transport import server

    store, _, addr = served(tcp_max_unauthenticated=8, tcp_max_unauthenticated_per_source=4, tcp_handshake_timeout_s=30)
    labels: dict[int, str] = {}  # the flood's local ports -> its two sources; the rest by address
    monkeypatch.setattr(server, "source_of", lambda peer: labels.get(peer[1], peer[0]))
    flood = SilentFlood(addr["port"], ["flood-a", "flood-b"], per_source=4, labels=labels)
    out = bytearray(5)
    try:
        wait_for(lambda: flood.greeted() == 8, timeout=20, what="the attack to fill the handshake pool")
        _push(addr, [(_key(), memoryview(b"legit"))], timeout=10)
        wait_for(
            lambda: flood.reopened >= 1 and flood.greeted() == 8,
            timeout=20,
            what="the attack to re-open what the push evicted and fill the pool again",
        )
        client = _client()
        try:
            assert client.fetch(addr, [(_key(), memoryview(out))], timeout=10) == [True]
        finally:
            client.close()
    finally:
        flood.stop()
    assert bytes(out) == b"legit" and store.keys() == [_key()]


def test_the_handshake_pool_is_shared_by_source_address():
    pool = Admission(size=4, per_source=2)
    assert [pool.admit(c, "a") for c in ("a1", "a2")] == [None, None]
    assert pool.admit("a3", "a") == "a1"  # "a" at its quota: its own oldest makes room
    assert [pool.admit(c, "b") for c in ("b1", "b2")] == [None, None]
    assert (len(pool), pool.count("a"), pool.count("b")) == (4, 2, 2)
    assert pool.admit("c1", "c") == "a2"  # full: the oldest of the heaviest addresses
    assert pool.admit("c2", "c") == "b1"  # now "b" and "c" hold 2 each
    assert not pool.leave("a1") and pool.leave("a3") and not pool.leave("a3")
    assert (len(pool), pool.count("a")) == (3, 0)


def test_a_full_pool_from_one_address_evicts_its_oldest_first():
    pool = Admission(size=3, per_source=3)
    assert [pool.admit(c, "a") for c in (1, 2, 3)] == [None, None, None]
    assert [pool.admit(c, "a") for c in (4, 5, 6, 7)] == [1, 2, 3, 4]


def test_a_flood_from_other_addresses_never_evicts_a_peer_in_its_handshake():
    pool = Admission(size=8, per_source=4)
    assert pool.admit("peer", "peer-address") is None
    evicted = [pool.admit(i, f"flood-{i % 3}") for i in range(1000)]
    assert "peer" not in evicted and pool.leave("peer")
    assert max(pool.count(f"flood-{j}") for j in range(3)) <= 4 and len(pool) == 7
    assert sum(v is not None for v in evicted) == 1000 - 7


def test_pool_tunables_below_one_are_refused(monkeypatch):
    monkeypatch.setenv("MEMSNAP_TCP_MAX_UNAUTHENTICATED_PER_SOURCE", "0")
    t = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    with pytest.raises(ConfigError, match="TCP_MAX_UNAUTHENTICATED_PER_SOURCE=0.*at least 1"):
        t.start(HeldChunks(MemoryBudget(1 << 20)))


def test_refused_connections_are_logged_once_per_interval_with_a_count(monkeypatch, caplog):
    monkeypatch.setenv("MEMSNAP_TCP_REFUSAL_LOG_S", "600")
    caplog.set_level(logging.WARNING, logger="memsnap.transport")
    server = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    addr = server.start(HeldChunks(MemoryBudget(1 << 20)))
    try:
        for _ in range(5):
            with socket.create_connection((addr["host"], addr["port"]), timeout=10) as s:
                s.sendall(b"not the protocol" * 8)
                assert _closed_by_peer(s)
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("dropped data-plane connection" in m for m in lines) == 1
    assert any("4 more data-plane connections were refused" in m for m in lines)


# --- slow and vanishing peers ------------------------------------------------------------------
def _trickle(sock: socket.socket, data: bytes, every: float, stop: threading.Event, sent: list) -> None:
    for b in data:
        try:
            sock.send(bytes([b]))
        except OSError:
            return
        sent[0] += 1
        if stop.wait(every):
            return


def test_handshake_trickled_one_byte_at_a_time_is_cut_at_its_deadline(served):
    _, _, addr = served(tcp_handshake_timeout_s=1)
    stop, sent = threading.Event(), [0]
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
        wire.recv_exact(sock, len(auth.MAGIC) + 1 + auth.NONCE, time.monotonic() + 10)
        t = threading.Thread(target=_trickle, args=(sock, os.urandom(HELLO), 0.1, stop, sent), daemon=True)
        t.start()
        try:
            assert _closed_by_peer(sock)
        finally:
            stop.set()
            t.join(timeout=10)
    assert sent[0] < HELLO  # cut off before the trickled hello was complete


def test_trickling_holder_fails_a_fetch_within_its_deadline():
    listener = socket.create_server(("127.0.0.1", 0))
    stop, sent, total = threading.Event(), [0], [0]
    payload = os.urandom(1000)

    def holder():
        conn, _ = listener.accept()
        with conn:
            session = auth.server_handshake(conn, SECRET, time.monotonic() + 10)
            wire.read_head(conn, session.recv, wire.REQUESTS, 0, time.monotonic() + 10)
            frame = Collect()
            wire.send_frame(
                frame,
                session.send,
                wire.OK,
                b"",
                memoryview(payload),
                xxhash.xxh3_64_intdigest(payload),
                time.monotonic() + 10,
            )
            total[0] = len(frame.data)
            _trickle(conn, bytes(frame.data), 0.05, stop, sent)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    client = _client()
    began = time.monotonic()
    try:
        with pytest.raises(TransportError, match="timed out"):
            client.fetch(
                {"host": "127.0.0.1", "port": listener.getsockname()[1]},
                [(_key(), memoryview(bytearray(1000)))],
                timeout=1.0,
            )
        assert time.monotonic() - began < 10  # a hang guard, not a timing claim
    finally:
        stop.set()
        client.close()
        t.join(timeout=10)
        listener.close()
    assert sent[0] < total[0]  # the holder was still trickling when the fetch gave up


def test_vanishing_pusher_releases_its_reservation(served):
    store, budget, addr = served(tcp_frame_timeout_s=2, tcp_idle_timeout_s=30)
    sock, session = _authed(addr)
    with sock:
        n = 1 << 20
        wire.send_head(sock, session.send, wire.PUSH, _key().pack(), n, 0, time.monotonic() + 10)
        wire.send_all(sock, os.urandom(n // 2), time.monotonic() + 10)  # half the chunk, then silence
        # one reading of both: the reservation lasts only tcp_frame_timeout_s
        wait_for(lambda: (store.pending(), budget.used) == (1, n), timeout=10, what="the chunk to be reserved")
        wait_for(lambda: store.pending() == 0 and budget.used == 0, timeout=10, what="the reservation to be released")
        assert _closed_by_peer(sock)
    assert store.keys() == []


def test_idle_connection_is_closed(served):
    _, _, addr = served(tcp_idle_timeout_s=0.5)
    sock, _ = _authed(addr)
    with sock:
        assert _closed_by_peer(sock)


# --- malformed frames --------------------------------------------------------------------------
def test_frame_over_the_chunk_bound_closes_the_connection(served):
    store, _, addr = served(max_chunk=4096)
    sock, session = _authed(addr)
    with sock:
        wire.send_head(sock, session.send, wire.PUSH, _key().pack(), 4097, 0, time.monotonic() + 10)
        assert _closed_by_peer(sock)
    with pytest.raises(TransportError):
        _push(addr, [(_key(stripe=1), memoryview(bytearray(8192)))])
    _push(addr, [(_key(stripe=2), memoryview(bytearray(4096)))])  # at the bound: fine
    assert store.keys() == [_key(stripe=2)]


def test_bad_key_closes_the_connection(served):
    store, _, addr = served()
    sock, session = _authed(addr)
    with sock:
        wire.send_head(sock, session.send, wire.PUSH, b"\x01\x02\x03", 4, 0, time.monotonic() + 10)
        assert _closed_by_peer(sock)
    assert store.pending() == 0 and store.keys() == []


def test_fetch_with_a_payload_closes_the_connection(served):
    _, _, addr = served()
    sock, session = _authed(addr)
    with sock:
        # the server may close on the header alone, before the body is sent: then the body's
        # send meets the close (EPIPE/ECONNRESET), which is the outcome under test
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            wire.send_frame(
                sock, session.send, wire.FETCH, _key().pack(), memoryview(b"junk"), 0, time.monotonic() + 10
            )
        assert _closed_by_peer(sock)


def test_wire_modes_must_match(served):
    _, _, addr = served(wire_mode="encrypt")
    with pytest.raises(TransportError, match="wire='encrypt'"):
        _push(addr, [(_key(), memoryview(b"x"))], wire="mac")


# --- the chunk store's bounds, through the wire ----------------------------------------------
def test_far_future_push_is_refused(served):
    store, budget, addr = served(step_window=10)
    _push(addr, [(_key(step=5), memoryview(b"now"))])
    used = budget.used
    with pytest.raises(TransportError, match="store_step_window"):
        _push(addr, [(_key(step=16), memoryview(b"far"))])
    assert budget.used == used and store.pending() == 0
    _push(addr, [(_key(step=15), memoryview(b"near"))])
    assert [k.step for k in store.keys()] == [5, 15]


def test_second_push_of_a_chunk_in_flight_is_refused(served):
    store, _, addr = served(tcp_frame_timeout_s=30)
    sock, session = _authed(addr)
    with sock:
        wire.send_head(sock, session.send, wire.PUSH, _key().pack(), 1000, 0, time.monotonic() + 10)
        wait_for(lambda: store.pending() == 1, timeout=10, what="the first transfer to begin")
        with pytest.raises(TransportError, match="already being received"):
            _push(addr, [(_key(), memoryview(b"x" * 1000))])
    wait_for(lambda: store.pending() == 0, timeout=10, what="the first transfer to be dropped")
    _push(addr, [(_key(), memoryview(b"y" * 1000))])
    assert bytes(store.lookup(_key())[0][:1000]) == b"y" * 1000


# --- a man in the middle ------------------------------------------------------------------------
class Edit:
    """Rewrites bytes ``[start, end)`` of one direction of a stream with ``fn`` (``cut``: and
    then closes it); the bytes before ``start`` pass at once, so the handshake is not held up."""

    def __init__(self, start: int, end: int, fn, cut: bool = False):
        self.start, self.end, self.fn, self.cut = start, end, fn, cut
        self.seen, self.held, self.done = 0, bytearray(), False

    def __call__(self, data: bytes) -> tuple[bytes, bool]:
        if self.done:
            return (b"", True) if self.cut else (data, False)
        pre = max(0, min(len(data), self.start - self.seen))
        self.seen += len(data)
        out, self.held = bytearray(data[:pre]), self.held + data[pre:]
        if len(self.held) >= self.end - self.start:
            cut_at = self.end - self.start
            out += self.fn(bytes(self.held[:cut_at]))
            self.done = True
            if self.cut:
                return bytes(out), True
            out += self.held[cut_at:]
        return bytes(out), False


def _passthrough(data: bytes) -> tuple[bytes, bool]:
    return data, False


class Relay:
    """A man in the middle on loopback: relays every connection to ``port``, editing it."""

    def __init__(self, port: int, c2s=None, s2c=None):
        self.target, self.c2s, self.s2c = port, c2s, s2c
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = {"transport": "tcp", "host": "127.0.0.1", "port": self.listener.getsockname()[1]}
        self.seen = {"c2s": bytearray(), "s2c": bytearray()}
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        self.listener.close()  # one connection: a client's retry finds nobody
        server = socket.create_connection(("127.0.0.1", self.target))
        self.socks += [client, server]
        for src, dst, edit, name in ((client, server, self.c2s, "c2s"), (server, client, self.s2c, "s2c")):
            threading.Thread(target=self._pump, args=(src, dst, edit or _passthrough, name), daemon=True).start()

    def _pump(self, src, dst, edit, name) -> None:
        try:
            while data := src.recv(65536):
                self.seen[name] += data
                out, cut = edit(data)
                dst.sendall(out)
                if cut:
                    break
        except OSError:
            pass
        # the far end first: the side that sent the bytes must not see the cut (and close the
        # relay) before the side that receives them has
        for s in (dst, src):
            _shut(s)

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            _shut(s)  # a bare close sends no FIN while a pump thread is blocked reading the socket
            s.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


HANDSHAKE = len(auth.MAGIC) + 1 + auth.NONCE + auth.MAC  # bytes of the handshake each way
N = 5000  # payload bytes of the chunks pushed through the relay


def _frame_len(key: ChunkKey, n: int = N) -> int:
    return wire.HEAD.size + len(key.pack()) + 16 + n + 16


def _flip(offset: int):
    return lambda seg: seg[:offset] + bytes([seg[offset] ^ 0x01]) + seg[offset + 1 :]


def _through(relay: Relay, items, **opts) -> None:
    client = _client(**opts)
    try:
        client.push(relay.addr, items, timeout=10)
    finally:
        client.close()
        relay.close()


@pytest.mark.parametrize("where", ["header", "checksum", "counter", "payload", "tag"])
def test_modified_push_frame_is_rejected(served, where):
    store, budget, addr = served()
    head = wire.HEAD.size + len(_key().pack())
    # the stored checksum (offset 11) is covered by the header tag alone; the payload counter (19) by both
    offset = {"header": 3, "checksum": 11, "counter": 19, "payload": head + 16 + 100, "tag": _frame_len(_key()) - 1}[
        where
    ]
    relay = Relay(addr["port"], c2s=Edit(HANDSHAKE + offset, HANDSHAKE + offset + 1, _flip(0)))
    with pytest.raises(TransportError):
        _through(relay, [(_key(), memoryview(os.urandom(N)))])
    wait_for(lambda: store.pending() == 0, timeout=10, what="the reservation to be dropped")
    assert store.keys() == [] and budget.used == 0


class Replay:
    """Passes frame ``[start, start + length)`` on and then sends it again in place of the next one."""

    def __init__(self, start: int, length: int):
        self.start, self.length, self.seen, self.buf = start, length, 0, bytearray()

    def __call__(self, data: bytes) -> tuple[bytes, bool]:
        at, self.seen = self.seen, self.seen + len(data)
        self.buf += data
        first, second = self.start + self.length, self.start + 2 * self.length
        if at >= second or self.seen <= first:
            return data, False
        if self.seen < second:  # hold the second frame until it is whole
            return data[: max(0, first - at)], False
        replayed = bytes(self.buf[self.start : first])
        return bytes(data[: max(0, first - at)]) + replayed + bytes(self.buf[second:]), False


def test_replayed_frame_is_rejected(served):
    store, _, addr = served()
    a, b = _key(stripe=0), _key(stripe=1)
    relay = Relay(addr["port"], c2s=Replay(HANDSHAKE, _frame_len(a)))
    client = _client()
    try:
        client.push(relay.addr, [(a, memoryview(os.urandom(N)))], timeout=10)  # acknowledged
        with pytest.raises(TransportError, match="stripe=1"):  # its frame replaced by a replay of a's
            client.push(relay.addr, [(b, memoryview(os.urandom(N)))], timeout=10)
    finally:
        client.close()
        relay.close()
    wait_for(lambda: store.pending() == 0, timeout=10, what="the connection to be dropped")
    assert store.keys() == [a]


def test_reordered_frames_are_rejected(served):
    store, _, addr = served()
    a, b = _key(stripe=0), _key(stripe=1)
    n = _frame_len(a)
    relay = Relay(addr["port"], c2s=Edit(HANDSHAKE, HANDSHAKE + 2 * n, lambda seg: seg[n:] + seg[:n]))
    with pytest.raises(TransportError):
        _through(relay, [(a, memoryview(os.urandom(N))), (b, memoryview(os.urandom(N)))])
    wait_for(lambda: store.pending() == 0, timeout=10, what="the connection to be dropped")
    assert store.keys() == []


def test_injected_frame_is_rejected(served):
    store, _, addr = served()
    forged = (
        wire.HEAD.pack(wire.PUSH, len(_key(stripe=7).pack()), 4, 0, 1)
        + _key(stripe=7).pack()
        + bytes(16)
        + b"evil"
        + bytes(16)
    )
    relay = Relay(addr["port"], c2s=Edit(HANDSHAKE, HANDSHAKE + 1, lambda seg: forged + seg))
    with pytest.raises(TransportError):
        _through(relay, [(_key(), memoryview(os.urandom(N)))])
    wait_for(lambda: store.pending() == 0, timeout=10, what="the connection to be dropped")
    assert store.keys() == []


def test_truncated_frame_is_dropped(served):
    store, budget, addr = served()
    relay = Relay(addr["port"], c2s=Edit(HANDSHAKE, HANDSHAKE + _frame_len(_key()) - 20, lambda seg: seg, cut=True))
    with pytest.raises(TransportError):
        _through(relay, [(_key(), memoryview(os.urandom(N)))])
    wait_for(lambda: store.pending() == 0 and budget.used == 0, timeout=10, what="the reservation to be dropped")
    assert store.keys() == []


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
def test_fetched_chunk_modified_in_transit_raises(served, mode):
    _, _, addr = served(wire_mode=mode)
    data = os.urandom(N)
    _push(addr, [(_key(), memoryview(data))], wire=mode)
    offset = wire.HEAD.size + 16 + 100  # a payload byte of the response
    relay = Relay(addr["port"], s2c=Edit(HANDSHAKE + offset, HANDSHAKE + offset + 1, _flip(0)))
    client = _client(wire=mode)
    try:
        with pytest.raises(TransportError, match="authentication tag"):
            client.fetch(relay.addr, [(_key(), memoryview(bytearray(N)))], timeout=10)
        out = bytearray(N)  # straight to the holder: the held chunk is intact
        assert client.fetch(addr, [(_key(), memoryview(out))], timeout=10) == [True]
    finally:
        client.close()
        relay.close()
    assert bytes(out) == data


def test_encrypted_stream_round_trips_and_hides_the_payload(served):
    store, _, addr = served(wire_mode="encrypt")
    data = b"plain secret text " * 400
    relay = Relay(addr["port"])
    _through(relay, [(_key(), memoryview(data))], wire="encrypt")
    assert b"plain secret text" not in bytes(relay.seen["c2s"])
    client = _client(wire="encrypt")
    try:
        out = bytearray(len(data))
        assert client.fetch(addr, [(_key(), memoryview(out))], timeout=10) == [True]
        store.flip_byte(_key(), 5)
        assert client.fetch(addr, [(_key(), memoryview(bytearray(len(data))))], timeout=10) == [False]
    finally:
        client.close()
    assert bytes(out) == data


def test_the_encrypt_tunable_picks_the_wire_mode(monkeypatch):
    assert _client().mode == "mac"
    monkeypatch.setenv("MEMSNAP_TCP_ENCRYPT", "1")
    assert _client().mode == "encrypt"
    with pytest.raises(ValueError, match="wire='plain'"):
        _client(wire="plain")
