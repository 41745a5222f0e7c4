"""What a fault does on its node: plain functions that run there (in a Ray task pinned to it).

Each returns a small JSON-ready dict (the event's detail) or raises. ``kill_raylet`` does not
return: it ends the process it runs in with the rest of the node.
"""

from __future__ import annotations

import errno
import os
import signal
import uuid

FILLER_PREFIX = ".memsnap-chaos-fill-"
BLOCK = 8 << 20


def find_raylet(pid: int | None = None, depth: int = 4) -> int:
    """The pid of the raylet above process ``pid`` (default: this one); a Ray worker is its child."""
    import psutil

    proc: psutil.Process | None = psutil.Process(pid or os.getpid())
    for _ in range(depth):
        assert proc is not None
        proc = proc.parent()
        if proc is None:
            break
        if proc.name() == "raylet":
            return proc.pid
    raise RuntimeError(f"no raylet above process {pid or os.getpid()}: not running inside a Ray worker")


def kill_raylet() -> dict:
    """SIGKILL this node's raylet and every process under it (its workers, agents, this one).

    A raylet that leads its own process group takes the group with it. One that shares its
    group with others (a loopback cluster, whose raylets share the group of the process that
    started them) is killed process by process, so nothing outside the node is touched."""
    import psutil

    raylet = find_raylet()
    tree = psutil.Process(raylet).children(recursive=True)
    me = os.getpid()
    os.kill(raylet, signal.SIGKILL)  # first, so that it starts no more workers
    for proc in tree:
        if proc.pid != me:
            _kill_quietly(proc.pid)
    if os.getpgid(raylet) == raylet:
        _killpg_quietly(raylet)
    os.kill(me, signal.SIGKILL)
    return {"raylet": raylet}  # (not reached)


def _kill_quietly(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _killpg_quietly(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pids(pids: list[int], sig: int) -> dict:
    """Send ``sig`` to each of ``pids``; never to this process, its parent (the raylet) or pid 1."""
    forbidden = {0, 1, os.getpid(), os.getppid()}
    bad = sorted(set(pids) & forbidden)
    if bad:
        raise ValueError(f"refusing to signal pid(s) {bad}: the node's init, raylet or this worker")
    sent = [p for p in pids if _kill_quietly(p, sig)]
    return {"signal": signal.Signals(sig).name, "pids": sent, "gone": sorted(set(pids) - set(sent))}


def fill(directory: str, limit_bytes: int | None = None, block: int = BLOCK, opener=open) -> dict:
    """Write a filler file into ``directory`` until the disk is full (ENOSPC or EDQUOT) or
    ``limit_bytes`` are written. The file stays (``unfill`` removes it); returns its path,
    its size and whether the disk filled up."""
    directory = _existing(directory)
    path = os.path.join(directory, f"{FILLER_PREFIX}{uuid.uuid4().hex[:12]}")
    chunk = memoryview(b"\xa5" * block)
    written, full = 0, False
    f = opener(path, "wb", buffering=0)  # unbuffered: every byte written is on its way to the disk
    try:
        while limit_bytes is None or written < limit_bytes:
            n = block if limit_bytes is None else min(block, limit_bytes - written)
            written += f.write(chunk[:n]) or 0
        os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            f.close()
            _remove(path)
            raise
        full = True
    finally:
        f.close()
    return {"path": path, "bytes": written, "full": full}


def _existing(directory: str) -> str:
    """``directory``, or its nearest existing ancestor (a spill root is made on its first write;
    the ancestor is on the same disk unless a mount point lies between)."""
    if not os.path.isabs(directory):
        raise ValueError(f"fill_disk: {directory!r} is not an absolute path")
    here = directory
    while not os.path.isdir(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return here


def unfill(path: str) -> dict:
    """Remove a filler file ``fill`` wrote (only such a file)."""
    if not os.path.basename(path).startswith(FILLER_PREFIX):
        raise ValueError(f"unfill: {path!r} is not a filler file of memsnap.chaos")
    return {"path": path, "removed": _remove(path)}


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
