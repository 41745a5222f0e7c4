"""The data-plane interface: the agent's chunk store and the transport contract.

``ChunkKey`` (``memsnap.coding.stripes``) and the buffer helpers ``byte_view``, ``Scatter`` and
``dest_parts`` (``memsnap.coding.buffers``) are re-exported here for the transports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

from memsnap.coding.buffers import Scatter, byte_view, dest_parts
from memsnap.coding.stripes import MAX_OWNER_BYTES, ChunkKey

__all__ = ["MAX_OWNER_BYTES", "ChunkKey", "ChunkStore", "Scatter", "Transport", "byte_view", "dest_parts"]


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
    def push(
        self,
        peer: dict,
        items: Sequence[tuple[ChunkKey, memoryview]],
        *,
        timeout: float,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        """Send every chunk (with its xxh3-64) and return once the peer acknowledged all.

        Several chunks are in flight at once. Raises TransportError naming the peer and the
        key on any failure (peer gone, timeout, the peer refused a chunk). ``cancel`` is asked
        before each chunk is sent: once it returns True the push stops there and raises
        ``PushCancelled`` (the chunks sent before it may or may not be held by the peer).
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
