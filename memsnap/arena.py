"""Agent-owned shared-memory arenas under /dev/shm, and the memory budget they count against.

An ``Arena`` is one file under ``/dev/shm`` created by the agent with ``ftruncate`` and
mapped with ``mmap``; every page is touched once at creation so that later copies into it
run at memory speed. Training processes ``attach`` to it once and keep the mapping, so the
bytes they capture live in memory the agent owns and survive the training process.
(``multiprocessing.shared_memory`` is not used: its resource tracker unlinks a segment
when an attaching process exits.)
"""
from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from memsnap.errors import MemoryBudgetError

PAGE = mmap.PAGESIZE


def touch(buf) -> None:
    """Write one byte in every page of ``buf`` so the kernel backs it now, not on first copy."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[::PAGE] = 0


class Arena:
    """One shared-memory file and its mapping. Create with ``create`` or ``attach``."""

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self._mm = mm
        self.owner = owner
        self.resident = True  # False after ``release`` until it is handed out again

    @classmethod
    def create(cls, path: str, nbytes: int, prefault: bool = True) -> "Arena":
        """A new file of ``nbytes`` (replacing any old one at ``path``), mapped and touched.

        ``prefault=False`` skips the touch, for a destination that is about to be filled
        whole anyway (a restore from peers), where it would only add a pass over the memory.
        """
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        if prefault:
            touch(mm)
        return cls(path, nbytes, mm, owner=True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "Arena":
        """Map an existing arena of at least ``nbytes`` (a training process does this once)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"arena {path} holds {size} bytes, {nbytes} were asked for")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm, owner=False)

    def release(self) -> None:
        """Give the pages back to the kernel: a hole is punched in the shared-memory file
        (``MADV_REMOVE``), which keeps its size, and every mapping reads zeros until it is
        written again. Lean mode does this once a snapshot's chunks are held by its peers."""
        with contextlib.suppress(ValueError, OSError):
            self._mm.madvise(mmap.MADV_REMOVE)
            self.resident = False

    def rename(self, path: str) -> None:
        """Give the shared-memory file a new name; the mapping stays as it is."""
        os.replace(self.path, path)
        self.path = path

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of ``nbytes`` (default: the rest) from ``offset``."""
        stop = self.nbytes if nbytes is None else offset + nbytes
        if not 0 <= offset <= stop <= len(self._mm):
            raise IndexError(f"arena {self.path}: [{offset}, {stop}) is outside its {self.nbytes} bytes")
        return memoryview(self._mm)[offset:stop]

    def close(self, unlink: bool | None = None) -> None:
        """Drop the mapping (left to the GC while views of it live); unlink if the owner asks."""
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        if self.owner if unlink is None else unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class MemoryBudget:
    """Bytes an agent has allocated, against its cap; refuses what does not fit."""

    def __init__(self, budget: int, node: str = "?"):
        self.budget = budget
        self.node = node
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more, or raise MemoryBudgetError saying what did not fit."""
        with self._lock:
            if self.used + nbytes > self.budget:
                raise MemoryBudgetError(
                    f"node {self.node[:12]}: {what} needs {nbytes} bytes but only "
                    f"{self.budget - self.used} of the memory_budget={self.budget} bytes are free "
                    f"({self.used} in use); raise memory_budget (Snapshotter(memory_budget=...)), "
                    f"or lower keep, or use fewer parity shards m"
                )
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)


class OwnedBuffer:
    """A private, touched buffer of the agent (parity, rebuild scratch) charged to a budget."""

    def __init__(self, budget: MemoryBudget, nbytes: int, what: str):
        budget.charge(nbytes, what)
        self._budget = budget
        self.nbytes = nbytes
        self.buf = mmap.mmap(-1, max(nbytes, 1))
        touch(self.buf)

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        stop = self.nbytes if nbytes is None else offset + nbytes
        return memoryview(self.buf)[offset:stop]

    def free(self) -> None:
        if self.nbytes >= 0:
            self._budget.release(self.nbytes)
            self.nbytes = -1
            with contextlib.suppress(BufferError, ValueError):
                self.buf.close()
