"""The payload MAC of wire="mac": GMAC per fixed piece, its nonces, and payloads landing in scattered views."""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash

from memsnap.arena import MemoryBudget
from memsnap.chunkstore import HeldChunks
from memsnap.transport import ChunkKey, make_transport, wire
from memsnap.transport.base import Scatter
from memsnap.transport.session import MAC_PIECE, FrameError, Session, pieces, verify_body
from memsnap.transport.tcp import TcpTransport, _Conn
from support.sockets import Collect

SECRET = os.urandom(32)
P = MAC_PIECE
ODD = [1, P - 7, 3, P + 5, 2 * P - 1, 100_003]  # view sizes that straddle the piece boundaries


def _pair() -> tuple[Session, Session]:
    """(client, server) sessions of one connection, as the handshake leaves them."""
    sn, cn = os.urandom(32), os.urandom(32)
    return Session(SECRET, "mac", sn, cn, is_server=False), Session(SECRET, "mac", sn, cn, is_server=True)


def _split(buf: bytearray, sizes: list[int]) -> list[memoryview]:
    view, at, parts = memoryview(buf), 0, []
    for n in sizes:
        parts.append(view[at:at + n])
        at += n
    assert at == len(buf)
    return parts


def _deadline() -> float:
    return time.monotonic() + 10


def test_pieces_cut_the_logical_payload_at_fixed_offsets_across_views():
    data = os.urandom(sum(ODD))
    got = [bytes(p) for p in pieces(_split(bytearray(data), ODD))]
    assert got == [data[at:at + P] for at in range(0, len(data), P)]


def test_frame_split_into_odd_views_verifies_and_a_flipped_byte_does_not():
    client, server = _pair()
    data = os.urandom(sum(ODD))
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=wire.send_frame, args=(a, client.send, wire.PUSH, b"k", memoryview(data),
                                                       0, _deadline())).start()
        head = wire.read_head(b, server.recv, wire.REQUESTS, len(data), _deadline())
        landed = bytearray(len(data))
        parts = _split(landed, ODD)
        tag = wire.read_body(b, server.recv, head.seq, head.tag, parts, _deadline())
        got = verify_body(server.recv, head.counter, head.seq, head.tag, parts, tag, True)
    assert bytes(landed) == data and got == xxhash.xxh3_64_intdigest(data)
    landed[ODD[0] + P - 7] ^= 1  # the first byte of a piece that straddles two views
    with pytest.raises(FrameError, match="payload failed its authentication tag"):
        verify_body(server.recv, head.counter, head.seq, head.tag, parts, tag, True)


def test_fetch_into_a_scatter_straddling_pieces_round_trips():
    store = HeldChunks(MemoryBudget(64 << 20))
    server = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire="mac")
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire="mac")
    key, data = ChunkKey(1, "peer", 0, 0), os.urandom(sum(ODD))
    try:
        addr = server.start(store)
        client.push(addr, [(key, memoryview(data))], timeout=10)
        dest = Scatter([bytearray(n) for n in ODD])
        assert client.fetch(addr, [(key, dest)], timeout=10) == [True]
    finally:
        client.close()
        server.close()
    assert b"".join(bytes(p) for p in dest.parts) == data


def _counters(stream: bytes) -> list[int]:
    """The payload counter of every frame in ``stream`` (frames as wire.py writes them)."""
    out, at = [], 0
    while at < len(stream):
        _, name_len, nbytes, _, counter = wire.HEAD.unpack_from(stream, at)
        out.append(counter)
        at += wire.HEAD.size + name_len + 16 + (nbytes + 16 if nbytes else 0)
    return out


def test_consecutive_frames_carry_distinct_payload_counters():
    client, _ = _pair()
    out = Collect()
    for n in (5, 0, P + 1, 7):
        payload = memoryview(os.urandom(n)) if n else None
        wire.send_frame(out, client.send, wire.PUSH, b"k", payload, 0, _deadline())
    assert _counters(bytes(out.data)) == [1, 0, 2, 3]  # no payload: 0


def test_chunks_sealed_out_of_order_on_two_threads_never_share_a_nonce():
    client, server = _pair()
    conn = _Conn(Collect(), client)
    transport = TcpTransport(secret=SECRET, host="127.0.0.1", wire="mac")
    chunks = [memoryview(os.urandom(1000 + i)) for i in range(64)]
    with ThreadPoolExecutor(2) as pool:
        sealed = list(pool.map(lambda v: transport._seal(conn, v), reversed(chunks)))[::-1]
    assert sealed[0][0] > sealed[-1][0]  # sealed out of order: the last chunk first
    assert len({counter for counter, _, _ in sealed}) == len(chunks)
    a, b = socket.socketpair()
    with a, b:  # sent in chunk order, whatever the order they were sealed in: every frame verifies
        threading.Thread(target=_send_sealed, args=(a, client, chunks, sealed)).start()
        for view in chunks:
            head = wire.read_head(b, server.recv, wire.REQUESTS, 1 << 20, _deadline())
            landed = bytearray(head.nbytes)
            tag = wire.read_body(b, server.recv, head.seq, head.tag, [memoryview(landed)], _deadline())
            verify_body(server.recv, head.counter, head.seq, head.tag, [memoryview(landed)], tag, False)
            assert landed == view and head.checksum == xxhash.xxh3_64_intdigest(view)


def _send_sealed(sock, session: Session, chunks, sealed) -> None:
    for view, (counter, tags, checksum) in zip(chunks, sealed):
        seq, tag = wire.send_head(sock, session.send, wire.PUSH, b"k", len(view), checksum, _deadline(), counter)
        wire.send_body(sock, session.send, seq, tag, view, _deadline(), counter, tags)


def test_a_payload_frame_without_a_counter_is_rejected():
    client, server = _pair()
    out = Collect()
    data = memoryview(os.urandom(100))
    seq, tag = wire.send_head(out, client.send, wire.PUSH, b"k", len(data), 0, _deadline(), 0)
    with pytest.raises(FrameError, match="payload counter 0"):
        wire.send_body(out, client.send, seq, tag, data, _deadline(), 0)
