"""Flat byte views of buffers, and a destination in pieces (``Scatter``): how bytes land in
live tensors without a copy on the way."""

from __future__ import annotations


def byte_view(buf) -> memoryview:
    """``buf`` (anything with the buffer protocol) as a flat unsigned-byte memoryview, no copy."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Scatter:
    """A fetch destination in pieces: the chunk's bytes land in ``parts`` in order.

    A restoring rank fetches a data shard straight into the live tensors it covers; a shard
    that spans several tensors (or the padding between them) is a scatter of their views.
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts):
        self.parts = [byte_view(p) for p in parts]
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def write(self, src) -> None:
        """Copy ``src`` (exactly ``nbytes``) into the parts."""
        src, at = byte_view(src), 0
        if len(src) != self.nbytes:
            raise ValueError(f"{len(src)} bytes written into a {self.nbytes}-byte scatter")
        for p in self.parts:
            p[:] = src[at : at + len(p)]
            at += len(p)

    def joined(self) -> bytes:
        """The bytes as one contiguous copy (for the codec, which reads whole shards)."""
        return b"".join(self.parts)


def dest_parts(buf) -> list[memoryview]:
    """A fetch destination (a buffer or a ``Scatter``) as its list of byte views."""
    return buf.parts if isinstance(buf, Scatter) else [byte_view(buf)]
