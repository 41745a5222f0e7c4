"""Per-connection frame protection: direction keys from the handshake, sequence numbers, MACs, AEAD.

After the handshake both ends hold the same two ``Direction`` objects, one per direction of
the stream, each with its own key derived (BLAKE3 ``derive_key``) from the job secret, both
handshake nonces and the wire mode. Every frame sent in a direction takes the next sequence
number of that direction; nothing of it travels, both ends count. A frame is protected by

- a header tag: keyed BLAKE3 over (sequence number, header bytes), 16 bytes, checked before
  the receiver acts on the header (reserves a buffer for it);
- a body tag over the payload: ``mac`` mode, keyed BLAKE3 over (payload, sequence number,
  header tag); ``encrypt`` mode, the payload is AES-256-GCM ciphertext whose tag covers the
  same, under a second key.

A replayed, reordered, dropped, truncated or modified frame therefore fails a tag.
"""
from __future__ import annotations

import hmac
import struct

import blake3
import xxhash

from memsnap.errors import TransportError

TAG = 16
MODES = ("mac", "encrypt")
HASH_PIECE = 256 << 10  # hash the MAC and the xxh3 of a chunk in pieces this large, both per piece,
                        # so the second hash reads the piece from cache (one pass over memory)
_SEQ = struct.Struct("<Q")


class FrameError(TransportError):
    """A frame failed its authentication or broke the protocol: the connection must close."""


def derive(secret: bytes, mode: str, server_nonce: bytes, client_nonce: bytes, purpose: str) -> bytes:
    """The 32-byte key for ``purpose`` of one connection (nonces are fixed-length, so unambiguous)."""
    h = blake3.blake3(derive_key_context=f"memsnap data plane 2026-11 {mode} {purpose}")
    h.update(server_nonce + client_nonce + secret)
    return h.digest()


class Direction:
    """One direction of one connection: its keys and its frame counter."""

    def __init__(self, mac_key: bytes, enc_key: bytes | None):
        self.mac_key = mac_key
        self.seq = 0
        self.aead = None
        if enc_key is not None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self.aead = AESGCM(enc_key)

    def next_seq(self) -> bytes:
        """This frame's sequence number (packed) and advance the counter."""
        seq = _SEQ.pack(self.seq)
        self.seq += 1
        return seq

    def head_tag(self, seq: bytes, head: bytes) -> bytes:
        return blake3.blake3(b"H" + seq + head, key=self.mac_key).digest(TAG)

    def check_head(self, seq: bytes, head: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(self.head_tag(seq, head), tag):
            raise FrameError("a frame header failed its authentication tag (injected, replayed or modified)")

    def body_hasher(self) -> "blake3.blake3":
        return blake3.blake3(key=self.mac_key)

    def nonce(self, seq: bytes) -> bytes:
        return seq + b"\0\0\0\0"


def body_tag(hasher, seq: bytes, head_tag: bytes) -> bytes:
    """Finish a payload MAC ``hasher`` (already fed the payload) for frame ``seq``."""
    hasher.update(b"B" + seq + head_tag)
    return hasher.digest(TAG)


def check_body(hasher, seq: bytes, head_tag: bytes, tag: bytes) -> None:
    if not hmac.compare_digest(body_tag(hasher, seq, head_tag), tag):
        raise FrameError("a frame's payload failed its authentication tag (modified in transit)")


def hash_pieces(parts, hasher, with_xxh3: bool) -> int:
    """Feed every view of ``parts`` to the MAC ``hasher`` and, with ``with_xxh3``, return the
    xxh3-64 of the same bytes, both per cache-sized piece (else 0)."""
    if not with_xxh3:
        for part in parts:
            hasher.update(part)
        return 0
    x = xxhash.xxh3_64()
    for part in parts:
        for at in range(0, len(part), HASH_PIECE):
            piece = part[at:at + HASH_PIECE]
            hasher.update(piece)
            x.update(piece)
    return x.intdigest()


class Session:
    """Both directions of one authenticated connection, seen from one end."""

    def __init__(self, secret: bytes, mode: str, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        if mode not in MODES:
            raise ValueError(f"wire={mode!r}: use one of {MODES}")
        self.mode = mode
        dirs = {}
        for name in ("c2s", "s2c"):
            enc = derive(secret, mode, server_nonce, client_nonce, name + " aead") if mode == "encrypt" else None
            dirs[name] = Direction(derive(secret, mode, server_nonce, client_nonce, name + " mac"), enc)
        self.send = dirs["s2c"] if is_server else dirs["c2s"]
        self.recv = dirs["c2s"] if is_server else dirs["s2c"]

    @property
    def encrypted(self) -> bool:
        return self.mode == "encrypt"
