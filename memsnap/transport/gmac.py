"""The payload GMAC of ``wire="mac"``: the tags of a payload's fixed-size pieces.

Piece ``i`` of a payload is tagged with AES-256-GCM, the piece as associated data and no
plaintext (GMAC), under the 12-byte nonce (payload counter as u64 LE, ``first + i`` as u32
LE); the tags are 16 bytes each, concatenated.
"""

from __future__ import annotations

import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_NONCE = struct.Struct("<QI")  # payload counter, piece index


class Gmac:
    """One key's GMAC over pieces of ``piece`` bytes."""

    def __init__(self, key: bytes, piece: int):
        self.piece, self._aesgcm = piece, AESGCM(key)

    def tags(self, counter: int, first: int, parts, also=None) -> bytes:
        """The tags of pieces ``first``, ``first + 1``, ... cut from the bytes of the views
        ``parts`` in order (a piece may straddle views; the last may be shorter); ``also``, a
        hash object, is fed the same bytes piece by piece, each while it is in cache."""
        out = []
        for index, piece in enumerate(pieces(parts, self.piece), first):
            out.append(self._aesgcm.encrypt(_NONCE.pack(counter, index), b"", piece))
            if also is not None:
                also.update(piece)
        return b"".join(out)


def pieces(parts, size: int):
    """The bytes of the views ``parts``, in order, as ``size``-byte pieces (the last shorter):
    a view where a piece lies within one part, a scratch copy where it straddles parts (valid
    until the next piece is taken)."""
    scratch: memoryview | None = None
    fill = 0
    for part in parts:
        at = 0
        if fill:  # finish the piece begun in the previous part
            assert scratch is not None
            at = min(size - fill, len(part))
            scratch[fill : fill + at] = part[:at]
            fill += at
            if fill < size:
                continue
            yield scratch
            fill = 0
        while len(part) - at >= size:
            yield part[at : at + size]
            at += size
        if at < len(part):
            scratch = scratch if scratch is not None else memoryview(bytearray(size))
            fill = len(part) - at
            scratch[:fill] = part[at:]
    if fill:
        assert scratch is not None
        yield scratch[:fill]
