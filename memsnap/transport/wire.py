"""The TCP data plane's binary framing: fixed struct headers, raw chunk bytes, no pickle.

After the handshake (auth.py) a client sends requests and the server answers each one, in
order, on the same connection:

    request  = REQUEST header (op, key length, payload length, xxh3-64) + packed key + payload
    response = RESPONSE header (status, message length, payload length, xxh3-64)
               + utf-8 message + payload

``PUSH`` carries a chunk as payload and is answered ``OK`` (stored) or ``FAILED`` (with a
message). ``FETCH`` has no payload and is answered ``OK`` with the held chunk and the
checksum recorded when it was stored, or ``MISSING``.
"""
from __future__ import annotations

import socket
import struct

from memsnap.validate import wire_header

REQUEST = struct.Struct("<BHQQ")   # op, key_len, nbytes, checksum
RESPONSE = struct.Struct("<BHQQ")  # status, msg_len, nbytes, checksum

PUSH, FETCH = 1, 2
OK, MISSING, FAILED = 0, 1, 2

PIECE = 4 << 20  # recv_into / sendall in pieces this large (>= 1 MiB keeps the syscall count low)
MAX_CHUNK = 1 << 40  # a sanity bound on a header's payload length


class ConnectionLost(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` exactly, in large ``MSG_WAITALL`` pieces."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:got + PIECE], min(PIECE, total - got), socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionLost(f"peer closed the connection after {got} of {total} bytes")
        got += n


IOV = 256  # buffers per recvmsg_into call (well under the kernel's IOV_MAX of 1024)


def recv_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Fill every view of ``parts`` in order from ``sock``: one scatter read (``recvmsg_into``)
    per up to ``IOV`` views, so a chunk spread over many small tensors costs few syscalls."""
    if len(parts) == 1:
        return recv_into(sock, parts[0])
    i, total, got = 0, sum(len(p) for p in parts), 0
    parts = [p for p in parts if len(p)]
    while i < len(parts):
        n = sock.recvmsg_into(parts[i:i + IOV], 0, socket.MSG_WAITALL)[0]
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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (for headers, keys and messages)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (a payload that has nowhere to go)."""
    scratch = memoryview(bytearray(min(n, PIECE) or 1))
    while n > 0:
        step = min(n, len(scratch))
        recv_into(sock, scratch[:step])
        n -= step


def send_payload(sock: socket.socket, view: memoryview) -> None:
    """Send ``view`` without copying it: ``sendall`` of memoryview slices."""
    for start in range(0, len(view), PIECE):
        sock.sendall(view[start:start + PIECE])


def send_request(sock: socket.socket, op: int, key: bytes, payload: memoryview | None, checksum: int) -> None:
    nbytes = 0 if payload is None else len(payload)
    sock.sendall(REQUEST.pack(op, len(key), nbytes, checksum) + key)
    if nbytes:
        send_payload(sock, payload)


def read_request(sock: socket.socket) -> tuple[int, bytes, int, int]:
    """``(op, packed key, payload length, checksum)``; the payload is left on the socket."""
    op, key_len, nbytes, checksum = wire_header(recv_exact(sock, REQUEST.size), REQUEST, (PUSH, FETCH),
                                                MAX_CHUNK, "request")
    return op, recv_exact(sock, key_len), nbytes, checksum


def send_response(sock: socket.socket, status: int, message: str = "",
                  payload: memoryview | None = None, checksum: int = 0) -> None:
    msg = message.encode()[:0xFFFF]
    nbytes = 0 if payload is None else len(payload)
    sock.sendall(RESPONSE.pack(status, len(msg), nbytes, checksum) + msg)
    if nbytes:
        send_payload(sock, payload)


def read_response(sock: socket.socket) -> tuple[int, str, int, int]:
    """``(status, message, payload length, checksum)``; the payload is left on the socket."""
    status, msg_len, nbytes, checksum = wire_header(recv_exact(sock, RESPONSE.size), RESPONSE,
                                                    (OK, MISSING, FAILED), MAX_CHUNK, "response")
    return status, recv_exact(sock, msg_len).decode(errors="replace"), nbytes, checksum
