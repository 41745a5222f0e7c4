"""The data-plane handshake: mutual HMAC-SHA256 challenge-response keyed by the job secret.

    server -> client   MAGIC + server nonce (32 bytes)
    client -> server   MAGIC + client nonce (32) + HMAC(secret, "client" + nonces)
    server -> client   HMAC(secret, "server" + nonces)

The server proves the secret only after the client has, so an outsider learns nothing; each
side checks the other's proof with a constant-time compare. The secret never crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

from memsnap.errors import AuthenticationError
from memsnap.transport import wire

MAGIC = b"MEMSNAP1"
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


def _mac(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + server_nonce + client_nonce, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int) -> bytes:
    try:
        return wire.recv_exact(sock, n)
    except wire.ConnectionLost as exc:
        raise AuthenticationError(f"peer closed the connection during the handshake ({exc})") from None


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate the client on ``sock``; raises AuthenticationError if it lacks the secret."""
    server_nonce = os.urandom(NONCE)
    sock.sendall(MAGIC + server_nonce)
    hello = _recv(sock, len(MAGIC) + NONCE + MAC)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("client did not speak the memsnap data-plane protocol")
    client_nonce, proof = hello[len(MAGIC):len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("client's proof of the job secret is wrong")
    sock.sendall(_mac(secret, b"server", server_nonce, client_nonce))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate to the server on ``sock`` and check that it knows the secret too."""
    hello = _recv(sock, len(MAGIC) + NONCE)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("server did not speak the memsnap data-plane protocol")
    server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE)
    sock.sendall(MAGIC + client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    proof = _recv(sock, MAC)
    if not hmac.compare_digest(proof, _mac(secret, b"server", server_nonce, client_nonce)):
        raise AuthenticationError("server's proof of the job secret is wrong (a different job's key?)")
