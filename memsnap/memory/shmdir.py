"""This user's private arena directory: made or checked, locked while files are made in it,
swept of the files no live process holds, removed once empty.

Liveness: the process that creates an arena keeps its file open under an exclusive ``flock``
for as long as it owns it (``Arena.create``). The kernel drops the lock when that process
exits, however it dies (SIGKILL, OOM), so a file nobody holds a lock on belongs to an agent
that is gone. Files are made under a shared lock on the directory and swept or the directory
removed under an exclusive one, so a sweep never sees a file between its creation and its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

from memsnap import naming
from memsnap.errors import MemsnapError, UnsafeShmError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def check_dir(st: os.stat_result, path: str) -> None:
    """UnsafeShmError unless ``st`` (an lstat/fstat of ``path``) is a directory of this user
    with mode 0700."""
    fix = "remove it (it is not memsnap's), or point MEMSNAP_SHM_DIR at another tmpfs"
    if st.st_uid != os.geteuid():
        raise UnsafeShmError(_planted(st, path))
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeShmError(f"arena directory {path} is a symlink; it is not followed: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeShmError(f"arena directory {path} is not a directory: {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        raise UnsafeShmError(
            f"arena directory {path} has mode {mode:04o}; it must be 0700 so no other "
            f"user can read snapshots: chmod 700 {path}, or {fix}"
        )


def _planted(st: os.stat_result, path: str) -> str:
    """The refusal of an entry of another user at the private directory's name, fix first: this
    user cannot remove it from a sticky tmpfs such as /dev/shm, so another tmpfs is the way out."""
    uid, parent = os.geteuid(), os.path.dirname(path)
    kind = "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "file"
    try:
        sticky = bool(os.stat(parent).st_mode & stat.S_ISVTX)
    except OSError:
        sticky = False
    removal = (
        f"in the sticky {parent} only uid {st.st_uid} or root can remove it"
        if sticky
        else "it is not used (remove it as its owner or root)"
    )
    return (
        f"set MEMSNAP_SHM_DIR=<a tmpfs directory of yours, e.g. /run/user/{uid}>: the arena "
        f"directory {path} belongs to uid {st.st_uid}, not to this user (uid {uid}), and is a {kind}; "
        f"another user may have planted it, and {removal}"
    )


def check_file(st: os.stat_result, path: str) -> None:
    """UnsafeShmError unless ``st`` (an fstat of ``path``) is a regular file of this user that
    no other user may open."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeShmError(f"arena {path} is not a regular file; remove it")
    if st.st_uid != os.geteuid():
        raise UnsafeShmError(
            f"arena {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); it is not used: remove it"
        )
    if st.st_mode & 0o077:
        raise UnsafeShmError(
            f"arena {path} has mode {stat.S_IMODE(st.st_mode):04o}, readable by other users; it is not used: remove it"
        )


def open_dir(path: str | None = None, create: bool = True) -> int:
    """A descriptor of the private arena directory ``path`` (default ``naming.arena_dir()``),
    made with mode 0700 if missing and ``create``; checked by ``check_dir`` either way."""
    path = path or naming.arena_dir()
    made = False
    if create:
        try:
            os.mkdir(path, 0o700)
            made = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise MemsnapError(
                f"cannot make the arena directory {path}: {os.path.dirname(path)} does "
                "not exist; mount a tmpfs there or set MEMSNAP_SHM_DIR"
            ) from None
    check_dir(os.lstat(path), path)  # a clear error for a symlink (O_NOFOLLOW says only ELOOP)
    fd = os.open(path, _DIR_FLAGS)
    try:
        if made:
            os.fchmod(fd, 0o700)  # exactly 0700 whatever the umask
        check_dir(os.fstat(fd), path)  # the directory opened is the one checked
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def making(path: str | None = None) -> Iterator[int]:
    """The private directory's descriptor, share-locked so no sweep or ``tidy`` runs while
    the caller makes files in it (relative to the descriptor)."""
    for _ in range(8):
        fd = open_dir(path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink:  # not removed by a tidy between open and lock
            break
        os.close(fd)
    else:
        raise MemsnapError(f"the arena directory {path or naming.arena_dir()} keeps disappearing")
    try:
        yield fd
    finally:
        os.close(fd)


def holds_no_lock(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a regular file of this user that no live process holds locked (its
    owner is gone); the caller holds the directory locked exclusively and may unlink it."""
    try:
        fd = os.open(name, PROBE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False  # gone meanwhile, or a symlink: not an arena of ours
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def sweep(path: str | None = None) -> list[str]:
    """Remove the arena files of owners that are gone (an agent killed by SIGKILL or the OOM
    killer leaves its arenas behind) and return their paths; a live agent's files stay.
    Call it when an agent starts. An unsafe directory (``check_dir``) raises UnsafeShmError."""
    path = path or naming.arena_dir()
    try:
        fd = open_dir(path, create=False)
    except FileNotFoundError:
        return []
    removed = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for name in sorted(os.listdir(fd)):
            if naming.parse_arena(name) is not None and holds_no_lock(fd, name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                    removed.append(os.path.join(path, name))
    finally:
        os.close(fd)
    tidy(path)
    return removed


def tidy(path: str | None = None) -> None:
    """Remove the private directory if it is empty and no file is being made in it, so nothing
    of memsnap stays on the tmpfs once the last arena is gone."""
    path = path or naming.arena_dir()
    try:
        fd = open_dir(path, create=False)
    except (OSError, MemsnapError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rmdir(path)
    except OSError as exc:  # busy (a file is being made), or not empty
        if exc.errno not in (errno.EWOULDBLOCK, errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
            raise
    finally:
        os.close(fd)


def remove_job(job: str) -> list[str]:
    """Unlink every arena file of ``job``, live or not (a test or the demo cleaning up after
    its agents were shut down or killed), then ``tidy``; returns the paths removed."""
    removed = []
    for path in arena_files(job):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    tidy()
    return removed


def arena_files(job: str, node_id: str | None = None) -> list[str]:
    """Every shared-memory file of exactly ``job`` (on ``node_id`` only, if given) that exists
    now; job ``bar`` does not match job ``bar-runtime``'s files."""
    d = naming.arena_dir()
    try:
        fd = open_dir(d, create=False)  # never listed through a symlink or another's dir
    except FileNotFoundError:
        return []
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    return sorted(os.path.join(d, n) for n in names if naming.is_arena_of(n, job, node_id))
