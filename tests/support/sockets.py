"""Socket stand-ins for the transport tests."""

from __future__ import annotations


class Collect:
    """A socket stand-in that keeps what is sent (to inspect frames, or to trickle them later)."""

    def __init__(self):
        self.data = bytearray()

    def send(self, data) -> int:
        self.data += data
        return len(data)

    def setsockopt(self, *args) -> None:
        pass


class Replay:
    """A socket stand-in that receives the bytes it was given, then the end of the stream."""

    def __init__(self, data):
        self.data, self.at = bytes(data), 0

    def recv_into(self, view, nbytes: int = 0, flags: int = 0) -> int:
        n = min(nbytes or len(view), len(self.data) - self.at)
        view[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n

    def setsockopt(self, *args) -> None:
        pass
