"""Agent-owned shared-memory arenas under /dev/shm, and the memory budget they count against.

An ``Arena`` is one file in this user's private directory ``/dev/shm/memsnap-<uid>/``
(mode 0700; ``memsnap.memory.shmdir``) created by the agent, backed whole with ``posix_fallocate``
(so a full /dev/shm is a ``MemoryBudgetError`` at creation, never a SIGBUS at first touch)
and mapped with ``mmap``; every page is touched once at creation so that later copies into
it run at memory speed. The agent keeps the file open under a ``flock`` for as long as it
owns it, which tells a ``sweep`` the owner is alive. Training processes ``attach`` to it once
and keep the mapping, so the bytes they capture live in memory the agent owns and survive
the training process. (``multiprocessing.shared_memory`` is not used: its resource tracker
unlinks a segment when an attaching process exits.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from memsnap import naming
from memsnap.errors import MemoryBudgetError, MemsnapError, UnsafeShmError
from memsnap.memory import shmdir

if TYPE_CHECKING:
    from memsnap.memory.pinning import Registration

PAGE = mmap.PAGESIZE
_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
log = logging.getLogger("memsnap.memory.arena")


def touch(buf) -> None:
    """Write one byte in every page of ``buf`` so the kernel backs it now, not on first copy."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[::PAGE] = 0


def _size(n: int) -> str:
    unit, scale = ("GiB", 1 << 30) if n >= 1 << 30 else ("MiB", 1 << 20)
    return f"{n} bytes ({n / scale:.1f} {unit})"


def space(directory: str) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem holding ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def no_room(directory: str, nbytes: int, what: str = "an arena") -> str:
    """Why ``nbytes`` do not fit in ``directory``'s tmpfs, and the settings that make them fit."""
    free, total = space(directory)
    return (
        f"{what} needs {_size(nbytes)} in {directory}, but its filesystem has only {_size(free)} "
        f"free of {_size(total)}. Give it more room (docker run --shm-size=<size>; on KubeRay mount "
        "an emptyDir {medium: Memory, sizeLimit: <size>} at /dev/shm), or lower memory_budget "
        "(Snapshotter(memory_budget=...)) to what this filesystem can hold"
    )


def _allocate(fd: int, size: int, directory: str, nbytes: int) -> None:
    """Back ``size`` bytes of ``fd`` now; MemoryBudgetError if the tmpfs has no room for them."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise MemoryBudgetError(no_room(directory, nbytes)) from exc
        raise


def check_capacity(memory_budget: int, need: int | None = None) -> dict:
    """Compare the free space of the arena filesystem with ``memory_budget``; call it once when
    an agent starts. Less free space than the budget is logged as a warning, not refused: the
    budget is a cap that snapshots rarely fill, and each arena is refused by itself, cleanly,
    when it does not fit (``Arena.create``). Less than ``need`` (the bytes one snapshot of the
    node needs, when the caller knows them) raises MemoryBudgetError. Returns what was compared."""
    root = naming.shm_root()
    free, total = space(root)
    if need is not None and free < need:
        raise MemoryBudgetError(no_room(root, need, "one snapshot of this node"))
    if free < memory_budget:
        log.warning(
            "memsnap: %s has %s free of %s, less than memory_budget=%s; a snapshot larger than "
            "the free space will be refused (Ray's object store may share this space too). Give it "
            "more room (docker run --shm-size=<size>; KubeRay: an emptyDir {medium: Memory, "
            "sizeLimit: <size>} at /dev/shm) or lower memory_budget",
            root,
            _size(free),
            _size(total),
            _size(memory_budget),
        )
    return {"dir": root, "free": free, "total": total, "memory_budget": memory_budget}


def sweep() -> list[str]:
    """Remove this user's arena files whose agent is gone (killed, OOM) and return their
    paths; a live agent's files stay. Call it when an agent starts (``shmdir.sweep``)."""
    return shmdir.sweep()


def _replace_stale(dir_fd: int, path: str, name: str) -> None:
    """Unlink the file at ``name`` if it is ours and its owner is gone; refuse anything else
    (a symlink is never followed, another user's file never reused)."""
    try:
        fd = os.open(name, shmdir.PROBE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeShmError(f"arena {path} is a symlink; it is not followed: remove it") from None
        raise
    try:
        shmdir.check_file(os.fstat(fd), path)
    finally:
        os.close(fd)
    if not shmdir.holds_no_lock(dir_fd, name):
        raise MemsnapError(
            f"arena {path} is held by a live process (another agent of the same job and node?); it is not replaced"
        )
    os.unlink(name, dir_fd=dir_fd)


def _new_file(dir_fd: int, path: str) -> int:
    """``path``'s new file (O_EXCL, O_NOFOLLOW, mode 0600), locked and checked; an old file of
    ours whose owner is gone is replaced."""
    name = os.path.basename(path)
    try:
        fd = os.open(name, _NEW, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        _replace_stale(dir_fd, path, name)
        fd = os.open(name, _NEW, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shmdir.check_file(os.fstat(fd), path)
    except BaseException:
        os.unlink(name, dir_fd=dir_fd)
        os.close(fd)
        raise
    return fd


class Arena:
    """One shared-memory file and its mapping. Create with ``create`` or ``attach``."""

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap, owner: bool, fd: int | None = None):
        self.path = path
        self.nbytes = nbytes
        self._mm = mm
        self._fd = fd  # the owner's open, locked file: its lock says the owner is alive
        self.owner = owner
        self.resident = True  # False after ``release`` until ``ensure_backed``
        self.pinning: Registration | None = None  # the CUDA registration (``pin``), when asked for
        self._repin = False  # ``release`` dropped a registration that ``ensure_backed`` makes again

    def pin(self):
        """Page-lock the whole arena for CUDA (``cudaHostRegister``) once, for its lifetime:
        DMA from a GPU then lands here directly. Without CUDA, or when CUDA refuses, nothing is
        pinned and ``pinning.reason`` says why (``memsnap.memory.pinning``)."""
        if self.pinning is None or not self.pinning.pinned:
            from memsnap.memory import pinning

            self.pinning = pinning.register(self._mm)
        return self.pinning

    def _unpin(self) -> bool:
        if self.pinning is None or not self.pinning.pinned:
            return False
        self.pinning.close()
        return True

    @classmethod
    def create(cls, path: str, nbytes: int, prefault: bool = True, pin: bool = False) -> Arena:
        """A new file of ``nbytes`` at ``path`` (a ``naming.arena_path``, in the private arena
        directory, which is made if missing), backed whole, mapped and touched.

        An old file at ``path`` whose owner is gone is replaced; a symlink, another user's
        file or one a live process holds is refused (UnsafeShmError/MemsnapError). No room on
        the tmpfs: MemoryBudgetError naming the fix, and no file is left behind.
        ``prefault=False`` skips the touch, for a destination that is about to be filled
        whole anyway (a restore from peers), where it would only add a pass over the memory.
        ``pin=True`` page-locks it for CUDA now (``pin``; skipped cleanly without CUDA).
        """
        directory, size = os.path.dirname(path), max(nbytes, 1)
        try:
            with shmdir.making(directory) as dir_fd:
                fd = _new_file(dir_fd, path)
                try:
                    _allocate(fd, size, directory, nbytes)
                    mm = mmap.mmap(fd, size)
                except BaseException:
                    os.unlink(os.path.basename(path), dir_fd=dir_fd)
                    os.close(fd)
                    raise
        except BaseException:
            shmdir.tidy(directory)  # leave no empty directory behind either
            raise
        if prefault:
            touch(mm)
        arena = cls(path, nbytes, mm, owner=True, fd=fd)
        if pin:  # once, at creation: never per snapshot
            arena.pin()
        return arena

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Arena:
        """Map an existing arena of at least ``nbytes`` (a training process does this once): a
        regular file of this user in the private arena directory; a symlink is not followed."""
        dir_fd = shmdir.open_dir(os.path.dirname(path), create=False)
        try:
            fd = os.open(os.path.basename(path), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeShmError(f"arena {path} is a symlink; it is not followed") from None
            raise
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            shmdir.check_file(st, path)
            if st.st_size < nbytes:
                raise ValueError(f"arena {path} holds {st.st_size} bytes, {nbytes} were asked for")
            # MAP_POPULATE: the page tables of the (already backed) file are filled here in one
            # go, not one fault per page on the first copy into it, which costs 3-4x the copy
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm, owner=False)

    def release(self) -> None:
        """Give the pages back to the kernel: a hole is punched in the shared-memory file
        (``MADV_REMOVE``), which keeps its size, and every mapping reads zeros until it is
        written again. Lean mode does this once a snapshot's chunks are held by its peers;
        ``ensure_backed`` must run before the arena is written again. A CUDA registration is
        dropped first (DMA must never reach the pages given back) and made again by
        ``ensure_backed``."""
        self._repin = self._unpin() or self._repin
        with contextlib.suppress(ValueError, OSError):
            self._mm.madvise(mmap.MADV_REMOVE)
            self.resident = False

    def ensure_backed(self) -> None:
        """Back the pages ``release`` gave back again, before the arena is handed out to be
        written (a write into a hole of a full tmpfs kills the writer with SIGBUS). No room:
        MemoryBudgetError naming the fix, and the arena stays released. Owner only."""
        if self.resident:
            return
        if self._fd is None:
            raise ValueError(f"arena {self.path}: only the process that created it can back it again")
        try:
            _allocate(self._fd, len(self._mm), os.path.dirname(self.path), self.nbytes)
        except MemoryBudgetError:
            with contextlib.suppress(ValueError, OSError):
                self._mm.madvise(mmap.MADV_REMOVE)  # what was backed before the failure
            raise
        self.resident = True
        if self._repin:
            self._repin = False
            self.pin()

    def rename(self, path: str) -> None:
        """Give the shared-memory file a new name in the same directory; the mapping (and the
        owner's lock) stays as it is."""
        if os.path.dirname(path) != os.path.dirname(self.path):
            raise ValueError(f"arena {self.path} can only be renamed within its directory, not to {path}")
        os.replace(self.path, path)
        self.path = path

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of ``nbytes`` (default: the rest) from ``offset``."""
        stop = self.nbytes if nbytes is None else offset + nbytes
        if not 0 <= offset <= stop <= len(self._mm):
            raise IndexError(f"arena {self.path}: [{offset}, {stop}) is outside its {self.nbytes} bytes")
        return memoryview(self._mm)[offset:stop]

    def close(self, unlink: bool | None = None) -> None:
        """Drop the mapping (left to the GC while views of it live) and the owner's lock;
        unlink if the owner asks, and remove the private directory if that emptied it."""
        self._unpin()  # before the pages can go
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        unlink = self.owner if unlink is None else unlink
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if unlink:
            shmdir.tidy(os.path.dirname(self.path))


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
