"""Arenas: shared-memory files the agent owns, attached by training processes; the budget."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from memsnap import naming
from memsnap.errors import MemoryBudgetError, UnsafeShmError
from memsnap.memory import shmdir
from memsnap.memory.arena import Arena, MemoryBudget, OwnedBuffer


@pytest.fixture
def path():
    p = naming.arena_path(f"test-{uuid.uuid4().hex[:8]}", "n0", 0, 0, 0)
    yield p
    if os.path.exists(p):
        os.unlink(p)
    shmdir.tidy()


def test_attached_writes_are_seen_by_the_owner_and_survive_the_writer(path):
    arena = Arena.create(path, 1 << 20)
    code = (
        f"from memsnap.memory.arena import Arena; a = Arena.attach({path!r}, 1 << 20); "
        "v = a.view(); v[:5] = b'hello'; v[-1:] = b'!'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.path.exists(path)  # the writer's exit did not unlink it
    assert bytes(arena.view(0, 5)) == b"hello" and bytes(arena.view(len(arena.view()) - 1)) == b"!"
    arena.close()
    assert not os.path.exists(path)


def _mapped_rss_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path``, summed (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" " + path)]
    assert starts, f"{path} is not mapped"
    return sum(int(next(f for f in lines[i + 1 :] if f.startswith("Rss:")).split()[1]) for i in starts)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_POPULATE and smaps are Linux")
def test_attach_maps_every_page_up_front_so_the_first_capture_takes_no_page_faults(path):
    """A training process attaches to an arena the agent has backed already; the first copy
    into a mapping that faults page by page costs 3-4x the copy itself, so attach fills the
    page tables at once (MAP_POPULATE): the whole mapping is resident before anything is written."""
    owner = Arena.create(path, 8 << 20)
    attached = Arena.attach(path, 8 << 20)
    try:
        assert _mapped_rss_kib(path) >= 2 * 8 * 1024  # the owner's mapping and the attached one, whole
    finally:
        attached.close(unlink=False)
        owner.close()


def test_attach_refuses_a_too_small_arena(path):
    Arena.create(path, 4096).close(unlink=False)
    with pytest.raises(ValueError, match="4096"):
        Arena.attach(path, 8192)


def test_view_bounds_are_checked(path):
    arena = Arena.create(path, 100)
    with pytest.raises(IndexError, match="outside"):
        arena.view(50, 51)
    arena.close()


def test_budget_refuses_with_the_sizes_and_the_setting_to_change():
    budget = MemoryBudget(1000, node="abcdef")
    budget.charge(600, "arena")
    with pytest.raises(MemoryBudgetError, match=r"needs 500 bytes.*400 of the memory_budget=1000"):
        budget.charge(500, "parity")
    budget.release(600)
    OwnedBuffer(budget, 1000, "parity").free()
    assert budget.used == 0


def test_arenas_live_in_a_private_directory_of_this_user(path):
    arena = Arena.create(path, 4096)
    d = os.lstat(os.path.dirname(path))
    f = os.lstat(path)
    assert os.path.dirname(path) == naming.arena_dir() and os.path.basename(naming.arena_dir()).startswith("memsnap-")
    assert (d.st_uid, d.st_mode & 0o7777) == (os.geteuid(), 0o700)
    assert (f.st_uid, f.st_mode & 0o777) == (os.geteuid(), 0o600)
    assert os.stat(path).st_blocks * 512 >= 4096  # backed at creation, not on first touch
    arena.close()
    assert not os.path.exists(path)


def test_a_created_arena_is_refused_outside_the_private_directory():
    with pytest.raises(UnsafeShmError, match="mode 1777"):
        Arena.create(f"/dev/shm/memsnap-test-{uuid.uuid4().hex[:8]}", 4096)
