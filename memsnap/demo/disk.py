"""The demo's comparison point: one rank's bytes read back from the durable tier the way a
replacement node reads them, with none of them in the page cache.

A replacement node has never seen the job's files, so its restore from storage reads every
byte from the device. Here the files were written (and fsynced) by the agents of this very
machine moments earlier, so the kernel still caches them: ``evict`` drops those pages
(``fsync``, which leaves them clean, then ``posix_fadvise(POSIX_FADV_DONTNEED)``, which only
drops clean pages), and ``resident`` counts what is left (``mincore``) so the report can show
the read started cold. The read itself is what ``Snapshotter`` does for the ``durable`` tier:
``Store.read_rank_into`` (whole-file xxh3) into a new buffer, then ``apply`` (per-tensor
checksums, copy into the live tensors).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Mapping
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def evict(path: str) -> None:
    """Write back and drop the cached pages of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: str) -> tuple[int, int]:
    """``(cached, total)`` pages of the file at ``path`` (``mincore``; mapping it reads nothing)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if size == 0:
        return 0, 0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        buf = (ctypes.c_char * size).from_buffer(mm)
        vec = (ctypes.c_ubyte * pages)()
        try:
            if _libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore({path}): {os.strerror(err)}")
            return sum(v & 1 for v in vec), pages
        finally:
            del buf
    finally:
        mm.close()


def cold_restore(spill_uri: str, step: int, rank: int, state: Mapping[str, Any]) -> dict:
    """Load ``rank``'s bytes of ``step`` from the local spill directory ``spill_uri`` into
    ``state`` from a cold page cache; return bytes, seconds (read, apply, total), GiB/s and
    the pages that were still cached when the read began."""
    from memsnap.durable.layout import rank_name
    from memsnap.durable.storage import Store
    from memsnap.state.apply import apply

    store = Store.open(spill_uri)
    if not store.local:
        raise ValueError(f"{spill_uri}: the demo's cold read needs a local spill directory")
    data = store.path(step, rank_name(rank, "bin"))
    evict(data)
    cached, pages = resident(data)
    t0 = time.perf_counter()
    man = store.manifest(step, rank)
    buf = bytearray(man.nbytes)
    store.read_rank_into(step, rank, buf)
    t1 = time.perf_counter()
    apply(state, man, buf, verify=True)
    t2 = time.perf_counter()
    return {
        "step": step,
        "rank": rank,
        "bytes": man.nbytes,
        "path": data,
        "seconds": t2 - t0,
        "read_s": t1 - t0,
        "apply_s": t2 - t1,
        "gib_per_s": man.nbytes / (t2 - t0) / (1 << 30),
        "cached_pages_before": cached,
        "pages": pages,
        "cache_drop": "fsync + posix_fadvise(POSIX_FADV_DONTNEED)",
    }
