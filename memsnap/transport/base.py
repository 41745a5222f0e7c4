"""The data-plane interface: chunk keys, the agent's chunk store, and the transport contract."""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# step (u64), stripe (u32), shard (u16), len(owner utf-8) (u16), then the owner bytes.
_KEY_HEAD = struct.Struct("<QIHH")
MAX_OWNER_BYTES = 0xFFFF


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


@dataclass(frozen=True, order=True)
class ChunkKey:
    """One chunk: shard ``shard`` of stripe ``stripe`` of node ``owner``'s bytes at ``step``.

    ``owner`` is the node id whose snapshot bytes the chunk comes from (not the holder).
    """

    step: int
    owner: str
    stripe: int
    shard: int

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not self.owner:
            raise ValueError(f"ChunkKey owner={self.owner!r}: pass the owner's node id as a non-empty str")
        for name, bound in (("step", 1 << 64), ("stripe", 1 << 32), ("shard", 1 << 16)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < bound:
                raise ValueError(f"ChunkKey {name}={value!r}: must be an int in [0, {bound})")
        if len(self.owner.encode()) > MAX_OWNER_BYTES:
            raise ValueError(f"ChunkKey owner is {len(self.owner.encode())} bytes; at most {MAX_OWNER_BYTES}")

    def pack(self) -> bytes:
        """The key as bytes: a fixed little-endian header and the owner's utf-8."""
        owner = self.owner.encode()
        return _KEY_HEAD.pack(self.step, self.stripe, self.shard, len(owner)) + owner

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkKey:
        """The key ``pack`` wrote; ValueError for anything else."""
        raw = bytes(raw)
        if len(raw) < _KEY_HEAD.size:
            raise ValueError(f"a packed ChunkKey is at least {_KEY_HEAD.size} bytes, got {len(raw)}")
        step, stripe, shard, n = _KEY_HEAD.unpack_from(raw)
        if len(raw) != _KEY_HEAD.size + n:
            raise ValueError(f"packed ChunkKey says owner is {n} bytes but {len(raw) - _KEY_HEAD.size} follow")
        return cls(step, raw[_KEY_HEAD.size :].decode(), stripe, shard)


class ChunkStore(Protocol):
    """Where an agent keeps the chunks it holds (implemented by the agent, which owns the RAM).

    A transport's server side calls, for every chunk that arrives:
      1. ``reserve(key, nbytes)`` -> a writable, preallocated destination of exactly ``nbytes``;
      2. then either ``complete(key, checksum)`` once the bytes are in and verified,
         or ``discard(key)`` when they did not arrive whole (connection lost, bad checksum).
    and ``lookup(key)`` when a peer fetches a chunk. A client may push the same key again
    (a retry on a fresh connection), so ``reserve`` of a key already held must replace it;
    ``reserve`` may raise to refuse a chunk (the pusher is told why), e.g. one still being
    received on another connection; ``StepGivenUp`` reaches the pusher as itself (the job gave
    the step up: not a failure). Calls come from several server threads at once.
    """

    def reserve(self, key: ChunkKey, nbytes: int) -> memoryview:
        """A writable destination for ``nbytes``; raises MemoryBudgetError when there is no room."""
        ...

    def complete(self, key: ChunkKey, checksum: int) -> None:
        """The chunk reserved under ``key`` arrived whole; ``checksum`` is its xxh3-64 integer."""
        ...

    def discard(self, key: ChunkKey) -> None:
        """A reserved chunk that did not arrive: free its reservation."""
        ...

    def lookup(self, key: ChunkKey) -> tuple[memoryview, int] | None:
        """The held bytes and their xxh3-64 integer, or None when the chunk is not held."""
        ...


class Transport(ABC):
    """Moves chunks between agents. One instance per agent: its server half and its client.

    Call protocol (each agent):
      1. ``addr = t.start(store)`` once; publish ``addr`` (JSON-able) to the peers;
      2. ``t.push(peer_addr, items, timeout=...)`` to send chunks to a holder, and
         ``t.fetch(peer_addr, items, timeout=...)`` to read chunks back; from any thread;
      3. ``t.close()`` once, at shutdown.
    """

    name: str = ""

    @abstractmethod
    def start(self, store: ChunkStore) -> dict:
        """Serve ``store`` to the peers; return the JSON-able address of this endpoint."""

    @abstractmethod
    def push(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> None:
        """Send every chunk (with its xxh3-64) and return once the peer acknowledged all.

        Several chunks are in flight at once. Raises TransportError naming the peer and the
        key on any failure (peer gone, timeout, the peer refused a chunk).
        """

    @abstractmethod
    def fetch(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> list[bool]:
        """Fill each buffer with the held chunk (exact length) and verify its checksum.

        A buffer may be a ``Scatter``: the chunk's bytes are spread over its parts in order.

        Returns one bool per item: False where the peer does not hold the chunk, its length
        differs from the buffer's, or its checksum fails (logged). Never raises for a missing
        chunk; raises TransportError when the peer cannot be reached or times out, or (TCP)
        when an answer fails its authentication (the buffers may then be partly written).
        """

    @abstractmethod
    def close(self) -> None:
        """Stop serving and drop every connection. Idempotent."""
