"""A rank's data file checked as its bytes go by, in one pass: the whole file's xxh3 against
``COMMITTED`` and every stored tensor's against its manifest."""

from __future__ import annotations

from typing import Any

import xxhash

from memsnap.errors import ChecksumError
from memsnap.state.manifest import Manifest


class Verifier:
    """Checks a rank's data file as its bytes go by, in order: the whole file's xxh3 against
    ``COMMITTED`` and every stored tensor's against its manifest (aliases hold no bytes), so
    one pass over the bytes checks both."""

    def __init__(self, path: str, manifest: Manifest, rec: dict):
        self.path, self.manifest, self.rec = path, manifest, rec
        self.whole = xxhash.xxh3_64()
        self.spans = sorted(
            (t.offset, t.offset + t.nbytes, i) for i, t in enumerate(manifest.tensors) if t.alias_of is None
        )
        self.open: list[tuple[int, int, int, Any]] = []  # (lo, hi, tensor, its xxh3 so far)
        self.next, self.done = 0, 0

    def feed(self, start: int, piece: memoryview) -> None:
        """The bytes at ``start`` (each byte once, in order)."""
        end = start + piece.nbytes
        self.whole.update(piece)
        spans = self.spans
        while self.next < len(spans) and spans[self.next][0] < end:
            lo, hi, i = spans[self.next]
            self.next += 1
            if hi <= end:  # wholly inside this piece: one call
                self._check(i, xxhash.xxh3_64_hexdigest(piece[lo - start : hi - start]))
            else:
                self.open.append((lo, hi, i, xxhash.xxh3_64()))
        still = []
        for lo, hi, i, h in self.open:
            h.update(piece[max(lo, start) - start : min(hi, end) - start])
            if hi <= end:
                self._check(i, h.hexdigest())
            else:
                still.append((lo, hi, i, h))
        self.open, self.done = still, end

    def finish(self) -> None:
        """After the last byte: the file's checksum, and the tensors not checked yet (empty
        ones at the very end)."""
        for _lo, _hi, i in self.spans[self.next :]:
            self._check(i, xxhash.xxh3_64_hexdigest(b""))
        digest = self.whole.hexdigest()
        if digest != self.rec["bin_xxh3"]:
            raise ChecksumError(f"{self.path} is corrupted: xxh3 {digest}, COMMITTED recorded {self.rec['bin_xxh3']}")

    def _check(self, i: int, got: str) -> None:
        t = self.manifest.tensors[i]
        if got != t.checksum:
            raise ChecksumError(
                f"{self.path} is corrupted: tensor {t.path!r} (bytes {t.offset}.."
                f"{t.offset + t.nbytes}) hashes to {got} but its manifest records "
                f"{t.checksum}; load another step or copy"
            )
