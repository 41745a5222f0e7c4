"""The chunks an agent holds for its peers: reserved, completed, looked up, freed and reused.

``HeldChunks`` implements the transport's ``ChunkStore`` protocol. Chunk buffers come from
a pool of touched buffers of equal size, charged once against the agent's memory budget and
reused after a version is freed, so receiving a snapshot never allocates fresh pages.
Two bounds keep a peer from pinning the budget: a push for a step more than
``store_step_window`` (a tunable) above the newest step the store knows is refused, and a
second reservation of a chunk still being received is refused (the two never share a
buffer), and so is a push for a step the job gave up. A discarded reservation (a chunk that did not arrive) goes back to the budget.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import xxhash

from memsnap.coding.stripes import ChunkKey
from memsnap.config import tunable
from memsnap.errors import MemoryBudgetError, StepGivenUp
from memsnap.memory.arena import MemoryBudget, touch

_GIVEN_UP_KEPT = 256  # abandoned steps remembered (a sender is never that many steps behind)


class ChunkRefused(ValueError):
    """A reservation the store will not make (a far-future step, a chunk already in flight)."""


class HeldChunks:
    """Thread-safe ``ChunkStore``: key -> (buffer, xxh3-64 integer)."""

    def __init__(self, budget: MemoryBudget, step_window: int | None = None):
        self._budget = budget
        self._window = int(tunable("store_step_window")) if step_window is None else step_window
        self._newest: int | None = None  # the newest step seen (held, reserved or announced)
        self._given_up: set[int] = set()  # steps the job abandoned: pushes for them are refused
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._pending: dict[ChunkKey, mmap.mmap] = {}
        self._held: dict[ChunkKey, tuple[mmap.mmap, int]] = {}
        self._stall: tuple[int, int] | None = None  # fault injection, see ``stall``
        self.stalled = threading.Event()
        self.own: Callable[[ChunkKey], tuple[memoryview, int] | None] | None = (
            None  # key -> (chunk, checksum) | None: data shards served from the owner's arena
        )

    # --- the ChunkStore protocol (called by the transport's server half) ------------------
    def reserve(self, key: ChunkKey, nbytes: int) -> memoryview:
        """A buffer for ``key``; ChunkRefused when ``key`` is already being received or its step
        is far above the newest step known, MemoryBudgetError when it does not fit."""
        with self._lock:
            self._admit(key)
            buf = self._take(nbytes, key)
            self._pending[key] = buf
            self._newest = key.step if self._newest is None else max(self._newest, key.step)
        return memoryview(buf)[:nbytes]

    def _admit(self, key: ChunkKey) -> None:
        if key in self._pending:
            raise ChunkRefused(
                f"chunk {key} is already being received (on another connection); retry once that transfer ends"
            )
        if key.step in self._given_up:
            raise StepGivenUp(f"chunk {key} is for step {key.step}, which the job gave up: it will never commit")
        if self._newest is not None and key.step > self._newest + self._window:
            raise ChunkRefused(
                f"chunk {key} is for step {key.step}, more than store_step_window="
                f"{self._window} steps above the newest step {self._newest} this node knows"
            )

    def announce(self, step: int) -> None:
        """The agent began or committed ``step``: pushes up to ``store_step_window`` above it are
        accepted from now on."""
        with self._lock:
            self._newest = step if self._newest is None else max(self._newest, step)

    def complete(self, key: ChunkKey, checksum: int) -> None:
        if self._stall is not None and key.step == self._stall[0]:
            self._stall_here()
        with self._lock:
            buf = self._pending.pop(key)
            old = self._held.pop(key, None)
            if old is not None:
                self._put_back(old[0])
            self._held[key] = (buf, int(checksum))

    def discard(self, key: ChunkKey) -> None:
        # the budget is released under the lock, so no reader sees the reservation gone and
        # its bytes still charged (the buffer is unmapped once the transport drops its view)
        with self._lock:
            buf = self._pending.pop(key, None)
            if buf is not None:
                self._budget.release(len(buf))

    def lookup(self, key: ChunkKey) -> tuple[memoryview, int] | None:
        """A held chunk and its checksum; else what ``own`` serves (the agent's own committed
        bytes, read by a rank that moved to another node), else None."""
        with self._lock:
            got = self._held.get(key)
        if got is None:
            return None if self.own is None else self.own(key)
        return memoryview(got[0]), got[1]

    # --- the agent's own use ---------------------------------------------------------------
    def put(self, key: ChunkKey, data) -> None:
        """Hold a copy of ``data`` under ``key`` (a chunk rebuilt locally)."""
        src = memoryview(data).cast("B")
        dst = self.reserve(key, len(src))
        dst[:] = src
        self.complete(key, xxhash.xxh3_64_intdigest(src))

    def give_up(self, step: int) -> int:
        """The job abandoned ``step``: its chunks are freed, and pushes for it refused from now
        on (a sender still sending it would otherwise fill the budget with a step that never
        commits, and nothing would free it). How many chunks were freed."""
        with self._lock:
            self._given_up.add(step)
            for s in sorted(self._given_up)[:-_GIVEN_UP_KEPT]:
                self._given_up.discard(s)
        return self.drop(lambda key: key.step != step)

    def reopen(self, after: int) -> None:
        """The job resumed from step ``after``: the steps above it may be taken again."""
        with self._lock:
            self._given_up = {s for s in self._given_up if s <= after}

    def drop(self, keep: Callable[[ChunkKey], bool]) -> int:
        """Free every held chunk for which ``keep(key)`` is false; return how many."""
        with self._lock:
            gone = [k for k in self._held if not keep(k)]
            for k in gone:
                self._put_back(self._held.pop(k)[0])
        return len(gone)

    def keys(self, step: int | None = None) -> list[ChunkKey]:
        with self._lock:
            return sorted(k for k in self._held if step is None or k.step == step)

    def inventory(self) -> dict[int, dict[str, dict[int, int]]]:
        """``{step: {owner: {shard: chunks held}}}``."""
        out: dict[int, dict[str, dict[int, int]]] = {}
        with self._lock:
            for key in self._held:
                shards = out.setdefault(key.step, {}).setdefault(key.owner, {})
                shards[key.shard] = shards.get(key.shard, 0) + 1
        return out

    def pending(self) -> int:
        """How many reservations are still being received."""
        with self._lock:
            return len(self._pending)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b, _ in self._held.values())

    def flip_byte(self, key: ChunkKey, offset: int = 0) -> None:
        """Corrupt one held byte (fault injection for tests and the demo)."""
        with self._lock:
            buf = self._held[key][0]
            buf[offset] ^= 0xFF

    def stall(self, step: int, after: int) -> None:
        """Fault injection: after ``after`` chunks of ``step`` arrive, block the receiving
        thread for good (no more acknowledgements), so a sender is stuck mid-transfer."""
        with self._lock:
            self._stall = (step, after)

    def _stall_here(self) -> None:
        with self._lock:
            assert self._stall is not None
            step, left = self._stall
            self._stall = (step, left - 1)
        if left <= 0:
            self.stalled.set()
            threading.Event().wait()  # until the process dies

    # --- the pool ----------------------------------------------------------------------------
    def _take(self, nbytes: int, key: ChunkKey) -> mmap.mmap:
        pool = self._free.get(nbytes)
        if pool:
            return pool.pop()
        try:
            self._budget.charge(nbytes, f"chunk {key}")
        except MemoryBudgetError:
            self._release_pools()  # buffers of other sizes, left from older layouts
            self._budget.charge(nbytes, f"chunk {key}")
        buf = mmap.mmap(-1, max(nbytes, 1))
        touch(buf)
        return buf

    def _put_back(self, buf: mmap.mmap) -> None:
        self._free.setdefault(len(buf), []).append(buf)

    def _release_pools(self) -> int:
        freed = sum(len(b) for pool in self._free.values() for b in pool)
        self._free.clear()
        self._budget.release(freed)
        return freed

    def trim(self) -> int:
        """Return every pooled (free) buffer to the OS and the budget; return bytes freed."""
        with self._lock:
            return self._release_pools()
