"""The TCP data plane's framing: deadline-bound socket I/O and authenticated frames, no pickle.

After the handshake (auth.py) a client sends requests and the server answers each one, in
order, on the same connection. Every frame, both ways, is

    HEAD (kind, name length, payload length, xxh3-64, payload counter) + name + header tag (16)
    [+ payload + body tag (16)]            when the payload length is not 0

``name`` is the packed chunk key of a request, the utf-8 message of a response. The tags
are session.py's, per direction, over a sequence number both ends count: keyed BLAKE3 over
the header; over the payload, GMAC per 256 KiB piece bound into one keyed BLAKE3 body tag
(``wire="mac"``) or AES-256-GCM (``wire="encrypt"``). The payload counter is the GMAC
nonce's first half, unique per payload and direction (0 when there is no payload, and in
``encrypt`` mode, whose nonce is the sequence number). ``PUSH`` carries a chunk and 0 in the
checksum field (the holder computes the xxh3-64 it stores over the bytes it authenticated) and
is answered ``OK``, ``FAILED`` (with a message) or ``GIVEN_UP`` (with a message: the job gave
the chunk's step up, so the push is in vain but nothing failed); ``FETCH`` has no payload and is answered
``OK`` with the chunk and the checksum stored with it, or ``MISSING``. In ``mac`` mode a
payload is tagged a ``SLICE`` at a time next to the socket copy of that slice, on both ends. Every receive and send is bounded by a deadline for the whole frame,
not per system call; a trickling peer cannot stretch it.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import NamedTuple

import xxhash

from memsnap.errors import FormatError
from memsnap.state.validate import wire_header
from memsnap.transport.session import (
    MAC_PIECE,
    TAG,
    Direction,
    FrameError,
    body_tag,
    check_body,
    mac_pieces,
)

HEAD = struct.Struct("<BHQQQ")  # kind (op or status), name length, payload length, xxh3-64, payload counter
REQUEST = RESPONSE = HEAD

PUSH, FETCH = 1, 2
OK, MISSING, FAILED, GIVEN_UP = 0, 1, 2, 3
REQUESTS, RESPONSES = (PUSH, FETCH), (OK, MISSING, FAILED, GIVEN_UP)

PIECE = 4 << 20  # recv_into / send in pieces this large (>= 1 MiB keeps the syscall count low)
SLICE = 1 << 20  # mac mode: a payload is tagged and moved this much at a time (a multiple of MAC_PIECE, fits L2)
IOV = 256  # buffers per recvmsg_into call (well under the kernel's IOV_MAX of 1024)


class ConnectionLost(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


class FrameTimeout(TimeoutError):
    """A frame did not arrive (or leave) whole before its deadline."""


def _arm(sock: socket.socket, deadline: float, opt: int) -> None:
    """Make the next blocking call on ``sock`` give up when ``deadline`` passes."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise FrameTimeout("the frame's deadline passed")
    sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(left), max(1, int((left % 1) * 1e6))))


def recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock`` exactly, in large ``MSG_WAITALL`` pieces, by ``deadline``."""
    got, total = 0, len(view)
    while got < total:
        _arm(sock, deadline, socket.SO_RCVTIMEO)
        try:
            n = sock.recv_into(view[got : got + PIECE], min(PIECE, total - got), socket.MSG_WAITALL)
        except BlockingIOError:
            raise FrameTimeout(f"{got} of {total} bytes arrived before the deadline") from None
        if n == 0:
            raise ConnectionLost(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_parts(sock: socket.socket, parts: list[memoryview], deadline: float) -> None:
    """Fill every view of ``parts`` in order from ``sock``: one scatter read (``recvmsg_into``)
    per up to ``IOV`` views, so a chunk spread over many small tensors costs few syscalls."""
    if len(parts) == 1:
        return recv_into(sock, parts[0], deadline)
    i, total, got = 0, sum(len(p) for p in parts), 0
    parts = [p for p in parts if len(p)]
    while i < len(parts):
        _arm(sock, deadline, socket.SO_RCVTIMEO)
        try:
            n = sock.recvmsg_into(parts[i : i + IOV], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:
            raise FrameTimeout(f"{got} of {total} bytes arrived before the deadline") from None
        if n == 0:
            raise ConnectionLost(f"peer closed the connection after {got} of {total} bytes")
        got += n
        while n and i < len(parts):  # step over the filled views; keep the rest of a partial one
            if n >= len(parts[i]):
                n -= len(parts[i])
                i += 1
            else:
                parts[i] = parts[i][n:]
                n = 0


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (headers, keys, messages, tags)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data, deadline: float) -> None:
    """Send ``data`` (no copy: memoryview slices) by ``deadline``."""
    view, at = memoryview(data).cast("B"), 0
    while at < len(view):
        _arm(sock, deadline, socket.SO_SNDTIMEO)
        try:
            at += sock.send(view[at : at + PIECE])
        except BlockingIOError:
            raise FrameTimeout(f"{at} of {len(view)} bytes left before the deadline") from None


# --- frames ---------------------------------------------------------------------------------
class Head(NamedTuple):
    """A received, authenticated frame header (its payload is still on the socket)."""

    seq: bytes
    kind: int
    name: bytes
    nbytes: int
    checksum: int
    counter: int  # the payload's GMAC counter (mac mode)
    tag: bytes
    deadline: float  # when the rest of the frame is due


def send_head(
    sock, d: Direction, kind: int, name: bytes, nbytes: int, checksum: int, deadline: float, counter: int = 0
) -> tuple[bytes, bytes]:
    """Send a frame's header; return its ``(sequence number, header tag)`` for the body."""
    seq = d.next_seq()
    head = HEAD.pack(kind, len(name), nbytes, checksum, counter) + name
    tag = d.head_tag(seq, head)
    send_all(sock, head + tag, deadline)
    return seq, tag


def send_body(
    sock,
    d: Direction,
    seq: bytes,
    head_tag: bytes,
    payload: memoryview,
    deadline: float,
    counter: int = 0,
    scratch: Scratch | None = None,
) -> None:
    """Send a frame's payload and body tag. ``mac`` mode: ``SLICE`` bytes at a time, each
    tagged (GMAC pieces under ``counter``) just before the socket copies it, so the copy reads
    it from cache; ``encrypt``: sealed whole into ``scratch``."""
    if d.aead is not None:
        assert scratch is not None, "encrypt mode seals into a Scratch"
        out = scratch.get(len(payload) + TAG)
        d.aead.encrypt_into(d.nonce(seq), payload, head_tag, out)
        return send_all(sock, out, deadline)
    tags = []
    for at in range(0, len(payload), SLICE):
        piece = payload[at : at + SLICE]
        tags.append(mac_pieces(d, counter, [piece], at // MAC_PIECE))
        send_all(sock, piece, deadline)
    send_all(sock, body_tag(d, seq, head_tag, b"".join(tags)), deadline)


def send_frame(
    sock,
    d: Direction,
    kind: int,
    name: bytes,
    payload: memoryview | None,
    checksum: int,
    deadline: float,
    scratch: Scratch | None = None,
) -> None:
    """Send a whole frame; a payload in mac mode takes the direction's next payload counter."""
    nbytes = 0 if payload is None else len(payload)
    counter = d.next_payload() if nbytes and d.gmac is not None else 0
    seq, tag = send_head(sock, d, kind, name, nbytes, checksum, deadline, counter)
    if payload is not None and nbytes:
        send_body(sock, d, seq, tag, payload, deadline, counter, scratch)


def read_head(
    sock, d: Direction, kinds: tuple, max_payload: int, deadline: float, frame_s: float | None = None
) -> Head:
    """The next frame's header, authenticated; the payload is left on the socket. The first
    byte must arrive by ``deadline``; the rest of the frame is due ``frame_s`` after it (None:
    by ``deadline``)."""
    raw = bytearray(HEAD.size)
    recv_into(sock, memoryview(raw)[:1], deadline)
    if frame_s is not None:
        deadline = time.monotonic() + frame_s
    recv_into(sock, memoryview(raw)[1:], deadline)
    try:
        kind, name_len, nbytes, checksum, counter = wire_header(bytes(raw), HEAD, kinds, max_payload, "frame")
    except FormatError as exc:  # the connection cannot go on: close it
        raise FrameError(str(exc)) from None
    rest = recv_exact(sock, name_len + TAG, deadline)
    seq = d.next_seq()
    d.check_head(seq, bytes(raw) + rest[:name_len], rest[name_len:])
    return Head(seq, kind, rest[:name_len], nbytes, checksum, counter, rest[name_len:], deadline)


def read_body(
    sock, d: Direction, head: Head, parts: list[memoryview], scratch: Scratch | None = None, with_xxh3: bool = False
) -> int:
    """Receive the payload of ``head`` into ``parts`` and check its tag (FrameError if it
    fails); return the xxh3-64 of the payload with ``with_xxh3`` (else 0). ``mac`` mode: a
    payload landing in one view is tagged ``SLICE`` bytes at a time as each lands, read from
    cache (scattered views: once all landed); ``encrypt``: decrypted and checked whole."""
    x = xxhash.xxh3_64() if with_xxh3 else None
    if not head.nbytes:  # a frame without payload has no body
        return x.intdigest() if x is not None else 0
    if d.aead is not None:
        assert scratch is not None, "encrypt mode opens from a Scratch"
        sealed = scratch.get(sum(len(p) for p in parts) + TAG)
        recv_into(sock, sealed, head.deadline)
        _open(d, head.seq, head.tag, sealed, parts, scratch)
        if x is not None:
            for p in parts:
                x.update(p)
    elif len(parts) == 1:
        view, slice_tags = parts[0], []
        for at in range(0, len(view), SLICE):
            piece = view[at : at + SLICE]
            recv_into(sock, piece, head.deadline)
            slice_tags.append(mac_pieces(d, head.counter, [piece], at // MAC_PIECE, x))
        check_body(d, head.seq, head.tag, b"".join(slice_tags), recv_exact(sock, TAG, head.deadline))
    else:
        recv_parts(sock, parts, head.deadline)
        piece_tags = mac_pieces(d, head.counter, parts, 0, x)
        check_body(d, head.seq, head.tag, piece_tags, recv_exact(sock, TAG, head.deadline))
    return x.intdigest() if x is not None else 0


def _open(d: Direction, seq: bytes, head_tag: bytes, sealed: memoryview, parts, scratch) -> None:
    from cryptography.exceptions import InvalidTag

    nbytes = len(sealed) - TAG
    out = parts[0] if len(parts) == 1 else scratch.get_plain(nbytes)
    assert d.aead is not None
    try:
        d.aead.decrypt_into(d.nonce(seq), sealed, head_tag, out)
    except InvalidTag:
        raise FrameError("a frame's payload failed its authentication tag (modified in transit)") from None
    if len(parts) > 1:
        at = 0
        for p in parts:
            p[:] = out[at : at + len(p)]
            at += len(p)


def drain(sock, nbytes: int, deadline: float) -> None:
    """Read and drop a frame's body: ``nbytes`` of payload and its tag (none when 0 bytes)."""
    if not nbytes:
        return
    scratch = memoryview(bytearray(min(nbytes + TAG, PIECE)))
    left = nbytes + TAG
    while left > 0:
        step = min(left, len(scratch))
        recv_into(sock, scratch[:step], deadline)
        left -= step


class Scratch:
    """Reused per-connection buffers for the ``encrypt`` mode (ciphertext, and plaintext
    bound for a scattered destination)."""

    def __init__(self):
        self._sealed = bytearray()
        self._plain = bytearray()

    def get(self, n: int) -> memoryview:
        if len(self._sealed) < n:
            self._sealed = bytearray(n)
        return memoryview(self._sealed)[:n]

    def get_plain(self, n: int) -> memoryview:
        if len(self._plain) < n:
            self._plain = bytearray(n)
        return memoryview(self._plain)[:n]
