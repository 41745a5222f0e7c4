"""Per-connection frame protection: direction keys from the handshake, sequence numbers, MACs, AEAD.

After the handshake both ends hold the same two ``Direction`` objects, one per direction of
the stream, each with its own keys derived (BLAKE3 ``derive_key``) from the job secret, both
handshake nonces, the wire mode and the key's purpose. Every frame sent in a direction takes
the next sequence number of that direction; nothing of it travels, both ends count. A frame
is protected by

- a header tag: keyed BLAKE3 over (sequence number, header bytes), 16 bytes, checked before
  the receiver acts on the header (reserves a buffer for it);
- a body tag over the payload. ``mac`` mode: the payload is cut into ``MAC_PIECE``-byte pieces,
  each authenticated with GMAC (AES-256-GCM with the piece as associated data) under the
  nonce (payload counter, piece index); the body tag is keyed BLAKE3 over (sequence number,
  header tag, piece count, piece tags). The payload counter is taken from a per-direction
  counter when the frame is sent, so no two payloads share a nonce, and travels in the
  header (covered by the header tag). The piece tags are not sent: the receiver recomputes
  them as the payload lands and checks the body tag. ``encrypt`` mode: the payload is
  AES-256-GCM ciphertext whose tag covers the same, under another key.

A replayed, reordered, dropped, truncated or modified frame therefore fails a tag.
"""

from __future__ import annotations

import hmac
import struct
import threading

import blake3
import xxhash

from memsnap.errors import TransportError

try:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError as exc:  # a hard dependency: say so rather than fail later
    raise ImportError(
        "memsnap's data plane needs the cryptography package (>= 45, for AES-GCM): pip install 'cryptography>=45'"
    ) from exc

from memsnap.transport.gmac import Gmac

TAG = 16
MODES = ("mac", "encrypt")
MAC_PIECE = 256 << 10  # the payload MAC's piece: GMAC and xxh3 of each in turn read it from cache
MAX_PIECES = 1 << 32  # the piece index is 4 bytes of the nonce
_SEQ = struct.Struct("<Q")


class FrameError(TransportError):
    """A frame failed its authentication or broke the protocol: the connection must close."""


def derive(secret: bytes, mode: str, server_nonce: bytes, client_nonce: bytes, purpose: str) -> bytes:
    """The 32-byte key for ``purpose`` of one connection (nonces are fixed-length, so unambiguous)."""
    h = blake3.blake3(derive_key_context=f"memsnap data plane 2026-11 {mode} {purpose}")
    h.update(server_nonce + client_nonce + secret)
    return h.digest()


class Direction:
    """One direction of one connection: its keys, its frame counter and its payload counter."""

    def __init__(self, mac_key: bytes, gmac_key: bytes | None, enc_key: bytes | None):
        self.mac_key = mac_key
        self.seq = 0
        self.gmac = Gmac(gmac_key, MAC_PIECE) if gmac_key is not None else None
        self.aead = AESGCM(enc_key) if enc_key is not None else None
        self._payloads = 0
        self._lock = threading.Lock()

    def next_seq(self) -> bytes:
        """This frame's sequence number (packed) and advance the counter."""
        seq = _SEQ.pack(self.seq)
        self.seq += 1
        return seq

    def next_payload(self) -> int:
        """A payload counter never handed out before in this direction (from 1; 0 means none)."""
        with self._lock:
            self._payloads += 1
            return self._payloads

    def head_tag(self, seq: bytes, head: bytes) -> bytes:
        return blake3.blake3(b"H" + seq + head, key=self.mac_key).digest(TAG)

    def check_head(self, seq: bytes, head: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(self.head_tag(seq, head), tag):
            raise FrameError("a frame header failed its authentication tag (injected, replayed or modified)")

    def nonce(self, seq: bytes) -> bytes:
        return seq + b"\0\0\0\0"


def body_tag(d: Direction, seq: bytes, head_tag: bytes, piece_tags: bytes) -> bytes:
    """The body tag of frame ``seq``: keyed BLAKE3 over its header tag and its piece tags
    (``piece_tags``: 16 bytes each, in order)."""
    h = blake3.blake3(b"B" + seq + head_tag + _SEQ.pack(len(piece_tags) // TAG), key=d.mac_key)
    h.update(piece_tags)
    return h.digest(TAG)


def check_body(d: Direction, seq: bytes, head_tag: bytes, piece_tags: bytes, tag: bytes) -> None:
    if not hmac.compare_digest(body_tag(d, seq, head_tag, piece_tags), tag):
        raise FrameError("a frame's payload failed its authentication tag (modified in transit)")


def mac_pieces(d: Direction, counter: int, parts, first: int = 0, also=None) -> bytes:
    """The GMAC tags of the pieces of ``parts`` (pieces ``first``, ``first + 1``, ... of a
    payload) under payload ``counter``, concatenated; ``also``, a hash object, is fed the same
    bytes (gmac.py)."""
    if counter < 1:
        raise FrameError(f"a frame with a payload carries payload counter {counter} (must be >= 1)")
    if first * MAC_PIECE + sum(len(p) for p in parts) > MAX_PIECES * MAC_PIECE:
        raise FrameError(f"a payload over {MAX_PIECES} pieces overflows the nonce's 4-byte piece index")
    assert d.gmac is not None, "mac_pieces is for a direction in mac mode"
    return d.gmac.tags(counter, first, parts, also)


def _direction(secret: bytes, mode: str, server_nonce: bytes, client_nonce: bytes, name: str) -> Direction:
    """Direction ``name`` ("c2s" or "s2c"): its header MAC key, and its payload GMAC key
    (``mac`` mode) or AEAD key (``encrypt``), each derived for its own purpose."""

    def key(purpose: str) -> bytes:
        return derive(secret, mode, server_nonce, client_nonce, f"{name} {purpose}")

    if mode == "mac":
        return Direction(key("mac"), key("payload gmac"), None)
    return Direction(key("mac"), None, key("aead"))


def verify_body(d: Direction, counter: int, seq: bytes, head_tag: bytes, parts, tag: bytes, with_xxh3: bool) -> int:
    """Check the payload that landed in ``parts`` against its body ``tag`` (FrameError if it
    fails); return its xxh3-64, computed in the same pass, with ``with_xxh3`` (else 0)."""
    x = xxhash.xxh3_64() if with_xxh3 else None
    check_body(d, seq, head_tag, mac_pieces(d, counter, parts, 0, x), tag)
    return x.intdigest() if x is not None else 0


class Session:
    """Both directions of one authenticated connection, seen from one end."""

    def __init__(self, secret: bytes, mode: str, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        if mode not in MODES:
            raise ValueError(f"wire={mode!r}: use one of {MODES}")
        self.mode = mode
        dirs = {name: _direction(secret, mode, server_nonce, client_nonce, name) for name in ("c2s", "s2c")}
        self.send = dirs["s2c"] if is_server else dirs["c2s"]
        self.recv = dirs["c2s"] if is_server else dirs["s2c"]

    @property
    def encrypted(self) -> bool:
        return self.mode == "encrypt"
