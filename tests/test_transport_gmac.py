"""The payload MAC of wire="mac": GMAC per fixed piece, its nonces, and payloads landing in scattered views."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash
from support.sockets import Collect, Replay

from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import HeldChunks
from memsnap.transport import ChunkKey, make_transport, wire
from memsnap.transport.base import Scatter
from memsnap.transport.gmac import pieces
from memsnap.transport.session import (
    MAC_PIECE,
    FrameError,
    Session,
    body_tag,
    mac_pieces,
    verify_body,
)
from memsnap.transport.tcp import TcpTransport

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
        parts.append(view[at : at + n])
        at += n
    assert at == len(buf)
    return parts


def _deadline() -> float:
    return time.monotonic() + 10


def test_pieces_cut_the_logical_payload_at_fixed_offsets_across_views():
    data = os.urandom(sum(ODD))
    got = [bytes(p) for p in pieces(_split(bytearray(data), ODD), P)]
    assert got == [data[at : at + P] for at in range(0, len(data), P)]


def test_frame_split_into_odd_views_verifies_and_a_flipped_byte_does_not():
    client, server = _pair()
    data = os.urandom(sum(ODD))
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(
            target=wire.send_frame, args=(a, client.send, wire.PUSH, b"k", memoryview(data), 0, _deadline())
        ).start()
        head = wire.read_head(b, server.recv, wire.REQUESTS, len(data), _deadline())
        landed = bytearray(len(data))
        parts = _split(landed, ODD)
        got = wire.read_body(b, server.recv, head, parts, with_xxh3=True)
    assert bytes(landed) == data and got == xxhash.xxh3_64_intdigest(data)
    tag = body_tag(client.send, head.seq, head.tag, mac_pieces(client.send, head.counter, [memoryview(data)]))
    assert verify_body(server.recv, head.counter, head.seq, head.tag, parts, tag, True) == got
    landed[ODD[0] + P - 7] ^= 1  # the first byte of a piece that straddles two views
    with pytest.raises(FrameError, match="payload failed its authentication tag"):
        verify_body(server.recv, head.counter, head.seq, head.tag, parts, tag, True)


@pytest.mark.parametrize("where", ["first slice", "last slice", "body tag"])
def test_a_payload_tagged_slice_by_slice_fails_when_any_byte_in_transit_is_flipped(where):
    """A chunk landing in one view is tagged a slice at a time as it lands; a byte flipped in
    the first or the last slice, or in the body tag, still fails the frame."""
    client, server = _pair()
    data = os.urandom(2 * wire.SLICE + 12345)
    out = Collect()
    wire.send_frame(out, client.send, wire.PUSH, b"k", memoryview(data), 0, _deadline())
    stream = bytearray(out.data)
    body = wire.HEAD.size + 1 + 16  # header, the 1-byte name, header tag
    stream[{"first slice": body + 3, "last slice": body + len(data) - 1, "body tag": len(stream) - 1}[where]] ^= 1
    sock = Replay(stream)
    head = wire.read_head(sock, server.recv, wire.REQUESTS, len(data), _deadline())
    with pytest.raises(FrameError, match="payload failed its authentication tag"):
        wire.read_body(sock, server.recv, head, [memoryview(bytearray(len(data)))], with_xxh3=True)


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


def test_payload_counters_taken_on_many_threads_are_all_distinct():
    """A direction hands out each payload counter (the GMAC nonce's first half) once, however
    many threads take them."""
    client, _ = _pair()
    with ThreadPoolExecutor(4) as pool:
        counters = list(pool.map(lambda _: client.send.next_payload(), range(2000)))
    assert sorted(counters) == list(range(1, 2001))


def test_a_payload_frame_without_a_counter_is_rejected():
    client, server = _pair()
    out = Collect()
    data = memoryview(os.urandom(100))
    seq, tag = wire.send_head(out, client.send, wire.PUSH, b"k", len(data), 0, _deadline(), 0)
    with pytest.raises(FrameError, match="payload counter 0"):
        wire.send_body(out, client.send, seq, tag, data, _deadline(), 0)
    sock = Replay(bytes(out.data) + bytes(data))  # and a receiver refuses one
    head = wire.read_head(sock, server.recv, wire.REQUESTS, len(data), _deadline())
    with pytest.raises(FrameError, match="payload counter 0"):
        wire.read_body(sock, server.recv, head, [memoryview(bytearray(len(data)))])


def test_the_holder_stores_the_checksum_of_the_bytes_it_authenticated_not_the_pushers():
    """A push's checksum field is not trusted: the holder stores the xxh3-64 it computed over
    the bytes whose tag it checked, so a fetch verifies against what really landed."""
    store = HeldChunks(MemoryBudget(64 << 20))
    server = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire="mac")
    client = TcpTransport(secret=SECRET, host="127.0.0.1", wire="mac")
    key, data = ChunkKey(1, "peer", 0, 0), os.urandom(3 * wire.SLICE + 5)
    try:
        addr = server.start(store)
        conn = client._connect((addr["host"], addr["port"]), _deadline())
        with conn.sock:
            wire.send_frame(conn.sock, conn.session.send, wire.PUSH, key.pack(), memoryview(data), 12345, _deadline())
            assert wire.read_head(conn.sock, conn.session.recv, wire.RESPONSES, 0, _deadline()).kind == wire.OK
        held, checksum = store.lookup(key)
        assert bytes(held) == data and checksum == xxhash.xxh3_64_intdigest(data)
        back = bytearray(len(data))
        assert client.fetch(addr, [(key, back)], timeout=10) == [True] and back == data
    finally:
        client.close()
        server.close()
