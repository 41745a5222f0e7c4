"""The data-plane handshake: mutual HMAC-SHA256 challenge-response keyed by the job secret.

    server -> client   MAGIC + wire mode (1 byte) + server nonce (32 bytes)
    client -> server   MAGIC + wire mode + client nonce (32) + HMAC(secret, "client" + mode + nonces)
    server -> client   HMAC(secret, "server" + mode + nonces)

The server proves the secret only after the client has, so an outsider learns nothing; each
side checks the other's proof with a constant-time compare. The secret never crosses the wire.
Both ends then derive the connection's frame keys (session.py) from the secret and both
nonces. The whole exchange must finish by one deadline, however the bytes trickle in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from memsnap.errors import AuthenticationError
from memsnap.transport import wire
from memsnap.transport.session import MODES, Session

MAGIC = b"MEMSNAP4"  # protocol version 4: the holder computes the checksum it stores (a push carries none)
NONCE = 32
MAC = 32


def check_secret(secret: bytes) -> bytes:
    """``secret`` if it is usable as the job key; ValueError saying how to make one otherwise."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ValueError(
            f"secret of type {type(secret).__name__} and length {len(secret) if hasattr(secret, '__len__') else '?'}"
            " is not a usable job key: pass at least 16 random bytes, e.g. os.urandom(32)"
        )
    return bytes(secret)


def _mac(secret: bytes, role: bytes, mode: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + mode + server_nonce + client_nonce, hashlib.sha256).digest()


def _check_magic(raw: bytes, who: str) -> None:
    """AuthenticationError unless ``raw`` opens with this protocol version's magic."""
    if raw[: len(MAGIC)] == MAGIC:
        return
    if raw[: len(MAGIC) - 1] == MAGIC[:-1]:
        raise AuthenticationError(
            f"{who} speaks data-plane protocol {raw[: len(MAGIC)].decode(errors='replace')}, "
            f"this agent {MAGIC.decode()}: run the same memsnap version on every agent of the job"
        )
    raise AuthenticationError(f"{who} did not speak the memsnap data-plane protocol ({MAGIC.decode()})")


def _mode_byte(mode: str) -> bytes:
    return bytes([MODES.index(mode)])


def _mode_of(raw: bytes, who: str) -> str:
    if raw[0] >= len(MODES):
        raise AuthenticationError(f"{who} asked for an unknown wire mode {raw[0]}")
    return MODES[raw[0]]


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        return wire.recv_exact(sock, n, deadline)
    except wire.ConnectionLost as exc:
        raise AuthenticationError(f"peer closed the connection during the handshake ({exc})") from None
    except wire.FrameTimeout:
        raise wire.FrameTimeout("the handshake did not finish before its deadline") from None


def server_handshake(sock: socket.socket, secret: bytes, deadline: float, mode: str = "mac") -> Session:
    """Authenticate the client on ``sock`` by ``deadline``; raises AuthenticationError if it
    lacks the secret or asks for another wire mode."""
    server_nonce, mb = os.urandom(NONCE), _mode_byte(mode)
    wire.send_all(sock, MAGIC + mb + server_nonce, deadline)
    hello = _recv(sock, len(MAGIC) + 1 + NONCE + MAC, deadline)
    _check_magic(hello, "client")
    their_mb = hello[len(MAGIC) : len(MAGIC) + 1]
    theirs = _mode_of(their_mb, "client")
    client_nonce, proof = hello[len(MAGIC) + 1 : len(MAGIC) + 1 + NONCE], hello[len(MAGIC) + 1 + NONCE :]
    if not hmac.compare_digest(proof, _mac(secret, b"client", their_mb, server_nonce, client_nonce)):
        raise AuthenticationError("client's proof of the job secret is wrong")
    if theirs != mode:
        raise AuthenticationError(f"client uses wire={theirs!r}, this server wire={mode!r}")
    wire.send_all(sock, _mac(secret, b"server", mb, server_nonce, client_nonce), deadline)
    return Session(secret, mode, server_nonce, client_nonce, is_server=True)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, mode: str = "mac") -> Session:
    """Authenticate to the server on ``sock`` by ``deadline`` and check that it knows the secret too."""
    hello = _recv(sock, len(MAGIC) + 1 + NONCE, deadline)
    _check_magic(hello, "server")
    theirs = _mode_of(hello[len(MAGIC) : len(MAGIC) + 1], "server")
    if theirs != mode:
        raise AuthenticationError(
            f"server uses wire={theirs!r}, this client wire={mode!r}: configure every agent of the job alike"
        )
    server_nonce, client_nonce, mb = hello[len(MAGIC) + 1 :], os.urandom(NONCE), _mode_byte(mode)
    wire.send_all(sock, MAGIC + mb + client_nonce + _mac(secret, b"client", mb, server_nonce, client_nonce), deadline)
    proof = _recv(sock, MAC, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"server", mb, server_nonce, client_nonce)):
        raise AuthenticationError("server's proof of the job secret is wrong (a different job's key?)")
    return Session(secret, mode, server_nonce, client_nonce, is_server=False)
