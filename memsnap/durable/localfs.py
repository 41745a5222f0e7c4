"""Local files written and read safely: temporary names of their own (``O_EXCL|O_NOFOLLOW``),
fsync of the file and its directory, no symlink or FIFO followed, pages handed to the disk
as they are written (``sync_file_range``), and a throttle for background writes.

``storage.Store`` uses these for roots on a local filesystem (``file://`` or a path), and
``write_stream`` (the hashed, throttled copy) for every other ``pyarrow.fs`` filesystem.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow.fs as pafs
import xxhash

from memsnap.errors import ChecksumError, StorageError

IO_CHUNK = 16 << 20  # every read and write is one sequential call of this size


WRITEBACK = 32 << 20  # a local data file's pages are handed to the disk every this many bytes (0: off)


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class Throttle:
    """Caps a stream at ``bps`` bytes/s by sleeping between chunks (None: no cap)."""

    def __init__(self, bps: float | None):
        if bps is not None and bps <= 0:
            raise ValueError(f"throttle_bps={bps} must be > 0 bytes/s, or None for no cap")
        self.bps, self.t0, self.done = bps, time.monotonic(), 0

    def account(self, n: int) -> None:
        self.done += n
        if self.bps:
            ahead = self.done / self.bps - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def read_upto(f, n: int) -> bytes:
    """Up to ``n`` bytes of ``f`` (fewer only at its end)."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(bytes(part))
        got += len(part)
    return b"".join(parts)


def readinto_full(f, mv: memoryview) -> int:
    got = 0
    while got < mv.nbytes:
        n = f.readinto(mv[got:])
        if not n:
            break
        got += n
    return got


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO opens without blocking


def open_local(path: str) -> int:
    """A read-only descriptor of the local file ``path``, opened through its directory
    (``O_NOFOLLOW`` on both: a symlinked step directory or file is refused, ``ChecksumError``);
    FileNotFoundError when it is absent."""
    head, name = os.path.split(path)
    try:
        dfd = os.open(head, _DIR_FLAGS)
        try:
            return os.open(name, _READ_FLAGS, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ChecksumError(
                f"{path} (or its step directory) is a symlink or not a file; memsnap "
                "reads no file through a symlink: the step is damaged or was not "
                "written by memsnap, load another step or copy"
            ) from None
        raise


def regular(path: str, st: os.stat_result, size: int | None) -> None:
    """``st`` is that of a regular file of ``size`` bytes (when given), or ChecksumError."""
    if not stat.S_ISREG(st.st_mode):
        raise ChecksumError(
            f"{path} is not a regular file; the step is damaged or was not written by "
            "memsnap, load another step or copy"
        )
    if size is not None and st.st_size != size:
        raise ChecksumError(f"{path} is truncated or damaged: {st.st_size} bytes on storage, COMMITTED recorded {size}")


def allocate(path: str, size: int) -> memoryview:
    """A new buffer of ``size`` bytes (the size of ``path`` on storage, checked before)."""
    try:
        return memoryview(np.empty(size, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    except (MemoryError, ValueError) as exc:
        raise StorageError(
            f"cannot allocate {size} bytes to read {path}: {exc or 'out of memory'}; "
            "free memory, or load on a machine with more"
        ) from None


def write_all(fd: int, mv: memoryview) -> None:
    """One sequential write of ``mv`` (loops over short writes)."""
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: str) -> str:
    """A temporary name next to ``path`` that no other writer picks: pid and 64 random bits."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def open_tmp(path: str) -> tuple[str, int]:
    """A new temporary file for ``path``: created exclusively, never through a symlink (a
    name that exists already, planted or not, is passed over for another)."""
    for _ in range(16):
        tmp = tmp_name(path)
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name next to {path}")


def slices(mv: memoryview) -> Iterator[memoryview]:
    """``mv`` in ``IO_CHUNK`` slices: the pieces a buffer is written in."""
    for start in range(0, mv.nbytes, IO_CHUNK):
        yield mv[start : start + IO_CHUNK]


def copy_out(
    parts: Iterable[memoryview],
    nbytes: int,
    sink: Callable[[memoryview], None],
    throttle: Throttle,
    progress: Progress | None,
) -> str:
    """Hash each of ``parts`` (while it is still in cache) and hand it to ``sink``; return the
    xxh3 of them all. Raises ValueError if they do not add up to ``nbytes``."""
    h, done = xxhash.xxh3_64(), 0
    for part in parts:
        part = memoryview(part).cast("B")
        h.update(part)
        sink(part)
        done += part.nbytes
        throttle.account(part.nbytes)
        if progress:
            progress(done, nbytes)
    if done != nbytes:
        raise ValueError(f"the data came to {done} bytes, {nbytes} were announced")
    return h.hexdigest()


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range(2)`` through ctypes (the GIL is released while it runs), or
    None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages, do not wait for them


class Writeback:
    """Starts the disk writing a file's pages every ``WRITEBACK`` bytes, while later pieces
    are still being hashed and copied, so the closing fsync has little left to wait for.
    Only a hint to the kernel: durability comes from that fsync, which also reports any
    error (so a failed hint is ignored)."""

    def __init__(self, fd: int):
        self.fd, self.done, self.started = fd, 0, 0

    def account(self, n: int) -> None:
        self.done += n
        if WRITEBACK and _SYNC_FILE_RANGE and self.done - self.started >= WRITEBACK:
            _SYNC_FILE_RANGE(self.fd, self.started, self.done - self.started, _SYNC_FILE_RANGE_WRITE)
            self.started = self.done


def write_local(
    path: str, parts: Iterable[memoryview], nbytes: int, throttle: Throttle, progress: Progress | None
) -> str:
    """Write ``parts`` to a temporary file of its own, fsync, rename to ``path``, fsync the
    directory; on any failure nothing of this write is left (the temporary file, or ``path``
    if it failed after the rename)."""
    (tmp, fd), renamed = open_tmp(path), False
    try:
        try:
            writeback = Writeback(fd)

            def sink(part: memoryview) -> None:
                write_all(fd, part)
                writeback.account(part.nbytes)

            digest = copy_out(parts, nbytes, sink, throttle, progress)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        renamed = True
        fsync_dir(os.path.dirname(path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path if renamed else tmp)
        raise
    return digest


def write_stream(
    fs: pafs.FileSystem,
    path: str,
    parts: Iterable[memoryview],
    nbytes: int,
    throttle: Throttle,
    progress: Progress | None,
) -> str:
    with fs.open_output_stream(path) as out:
        return copy_out(parts, nbytes, out.write, throttle, progress)
