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
