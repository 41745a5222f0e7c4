"""Where a rank's fetched bytes land: one flat buffer, or straight into many (its live tensors).

A restore from peers reads each data shard into the bytes it covers in the rank's stream.
``Flat`` is that stream as one buffer (the agent's arena). ``Spans`` is the stream laid over
separate buffers, one per tensor, with small scratch pieces for the alignment padding
between them: a shard that covers several tensors becomes a ``Scatter`` of their views and
the socket reads straight into them. Both answer ``view(a, b)`` (a fetch destination for
bytes ``[a, b)``) and ``write(a, src)`` (for a stripe rebuilt from parity). No torch here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from memsnap.coding.buffers import Scatter, byte_view


class Flat:
    """The stream as one writable buffer."""

    def __init__(self, buf):
        self.mv = byte_view(buf)
        self.nbytes = len(self.mv)

    def view(self, a: int, b: int) -> memoryview:
        return self.mv[a:b]

    def write(self, a: int, src) -> None:
        src = byte_view(src)
        self.mv[a : a + len(src)] = src


class Spans:
    """The stream ``[0, nbytes)`` over separate buffers: ``pieces`` is ``[(offset, buffer)]``.

    The pieces must not overlap; every gap between them (and after the last, up to
    ``nbytes``) is covered by a scratch buffer whose bytes are received and then ignored.
    ``within``: when only these ``[(start, stop)]`` ranges of the stream are fetched (a
    partial read), scratch covers only the gaps inside them: the skipped bytes cost nothing.
    """

    def __init__(
        self, pieces: Sequence[tuple[int, object]], nbytes: int, within: Sequence[tuple[int, int]] | None = None
    ):
        views = sorted(((off, byte_view(buf)) for off, buf in pieces if len(byte_view(buf))), key=lambda p: p[0])
        self.starts: list[int] = []
        self.views: list[memoryview] = []
        self._within = sorted(within) if within is not None else [(0, nbytes)]
        at = 0
        for off, v in views:
            if off < at:
                raise ValueError(f"piece at byte {off} overlaps the one before it (which ends at {at})")
            self._gap(at, off)
            self._add(off, v)
            at = off + len(v)
        if at > nbytes:
            raise ValueError(f"pieces end at byte {at}, past the stream's {nbytes} bytes")
        self._gap(at, nbytes)
        self.nbytes = nbytes

    def _gap(self, a: int, b: int) -> None:
        for lo, hi in self._within:
            lo, hi = max(a, lo), min(b, hi)
            if hi > lo:
                self._add(lo, memoryview(bytearray(hi - lo)))

    def _add(self, off: int, v: memoryview) -> None:
        self.starts.append(off)
        self.views.append(v)

    def _pieces(self, a: int, b: int) -> list[memoryview]:
        if not 0 <= a <= b <= self.nbytes:
            raise IndexError(f"[{a}, {b}) is outside the stream's {self.nbytes} bytes")
        out, i = [], max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.views) and self.starts[i] < b:
            off, v = self.starts[i], self.views[i]
            lo, hi = max(a, off) - off, min(b, off + len(v)) - off
            if hi > lo:
                out.append(v[lo:hi])
            i += 1
        return out

    def view(self, a: int, b: int):
        parts = self._pieces(a, b)
        return parts[0] if len(parts) == 1 else Scatter(parts)

    def write(self, a: int, src) -> None:
        src = byte_view(src)
        Scatter(self._pieces(a, a + len(src))).write(src)
