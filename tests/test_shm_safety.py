"""/dev/shm safety: no SIGBUS on a full tmpfs, never another user's file, dead agents swept."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from memsnap import naming
from memsnap.config import SnapshotConfig
from memsnap.errors import ConfigError, MemoryBudgetError, MemsnapError, UnsafeShmError
from memsnap.memory import shmdir
from memsnap.memory.arena import Arena, check_capacity, space, sweep

MiB = 1 << 20
OTHER_UID = 54321  # a uid that is not ours, for files "another user planted" (root only)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """An arena root of this test's own (MEMSNAP_SHM_DIR), so the real /dev/shm is not touched."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("MEMSNAP_SHM_DIR", str(root))
    return str(root)


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """An 8 MiB tmpfs as the arena root (root only; skipped where mounting is refused)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    root = tmp_path / "tmpfs"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs was refused here")
    monkeypatch.setenv("MEMSNAP_SHM_DIR", str(root))
    try:
        yield str(root)
    finally:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(root)], check=True)


def path(job: str = "t", node: str = "n0", rank: int = 0) -> str:
    return naming.arena_path(job, node, rank, 0, 0)


def python(code: str, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this environment (MEMSNAP_SHM_DIR included)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, **kw)


# --- a full tmpfs: a clean MemoryBudgetError, never a SIGBUS --------------------------------------
def test_an_arena_larger_than_the_free_tmpfs_is_refused_not_a_sigbus(small_tmpfs):
    p = path()
    # what the old ftruncate-only arena did here: the first touch beyond the free space kills
    hazard = python(f"""
        import mmap, os
        fd = os.open({small_tmpfs + "/hazard"!r}, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 16 << 20)
        mm = mmap.mmap(fd, 16 << 20)
        mm[::4096] = bytes(4096)
    """)
    os.unlink(os.path.join(small_tmpfs, "hazard"))
    assert hazard.returncode == -signal.SIGBUS
    out = python(f"""
        from memsnap.memory.arena import Arena
        from memsnap.errors import MemoryBudgetError
        try:
            Arena.create({p!r}, 16 << 20)
        except MemoryBudgetError as exc:
            print(exc)
        else:
            raise SystemExit("created")
    """)
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert f"needs {16 * MiB} bytes" in msg and small_tmpfs in msg and "free of" in msg
    assert "--shm-size" in msg and "emptyDir {medium: Memory, sizeLimit:" in msg and "memory_budget" in msg
    assert os.listdir(small_tmpfs) == []  # no partial file left, nor an empty directory
    assert space(small_tmpfs)[0] > 7 * MiB  # and nothing of it holds memory


def test_a_released_arena_is_backed_again_or_refused_when_the_tmpfs_filled(small_tmpfs):
    arena = Arena.create(path(), 4 * MiB)
    try:
        arena.view(0, 4)[:] = b"data"
        backed = space(small_tmpfs)[0]
        arena.release()
        assert not arena.resident and space(small_tmpfs)[0] == backed + 4 * MiB
        arena.ensure_backed()
        assert arena.resident and space(small_tmpfs)[0] == backed
        arena.view()[:] = b"\1" * (4 * MiB)  # every page writable: backed, no SIGBUS
        arena.release()
        filler = os.path.join(small_tmpfs, "filler")  # someone else fills /dev/shm meanwhile
        fd = os.open(filler, os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, space(small_tmpfs)[0] - MiB)
        os.close(fd)
        free = space(small_tmpfs)[0]
        with pytest.raises(MemoryBudgetError, match=r"needs 4194304 bytes .*--shm-size"):
            arena.ensure_backed()
        assert not arena.resident and space(small_tmpfs)[0] == free  # nothing half-backed kept
        os.unlink(filler)
        arena.ensure_backed()
        assert arena.resident and bytes(arena.view(0, 4)) == bytes(4)
    finally:
        arena.close()


def test_check_capacity_warns_below_the_budget_and_refuses_below_one_snapshot(small_tmpfs, caplog):
    with caplog.at_level(logging.WARNING, logger="memsnap.memory.arena"):
        info = check_capacity(4 << 30)
    assert info["dir"] == small_tmpfs and info["total"] == 8 * MiB and info["memory_budget"] == 4 << 30
    [record] = caplog.records
    assert small_tmpfs in record.getMessage() and "--shm-size" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memsnap.memory.arena"):
        check_capacity(4 * MiB, need=2 * MiB)
    assert caplog.records == []
    with pytest.raises(MemoryBudgetError, match=r"one snapshot of this node needs 67108864 bytes"):
        check_capacity(4 * MiB, need=64 * MiB)


# --- the private directory ---------------------------------------------------------------------
def test_the_private_directory_is_made_0700_and_removed_with_its_last_arena(shm):
    a, b = Arena.create(path(rank=0), 4096), Arena.create(path(rank=1), 4096)
    st = os.lstat(naming.arena_dir())
    assert naming.arena_dir() == os.path.join(shm, f"memsnap-{os.geteuid()}")
    assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o700)
    a.close()
    assert os.path.isdir(naming.arena_dir())
    b.close()
    assert os.listdir(shm) == []


def test_a_symlinked_private_directory_is_refused(shm, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, naming.arena_dir())
    (elsewhere / os.path.basename(path())).write_bytes(b"not an arena of ours")
    with pytest.raises(UnsafeShmError, match="is a symlink"):
        Arena.create(path(), 4096)
    with pytest.raises(UnsafeShmError, match="is a symlink"):
        shmdir.remove_job("t")  # a cleanup does not delete through it either
    with pytest.raises(UnsafeShmError, match="is a symlink"):
        sweep()
    assert [p.name for p in elsewhere.iterdir()] == [os.path.basename(path())]


def test_a_private_directory_with_loose_permissions_is_refused(shm):
    os.mkdir(naming.arena_dir(), 0o700)
    os.chmod(naming.arena_dir(), 0o777)
    with pytest.raises(UnsafeShmError, match="mode 0777.*chmod 700"):
        Arena.create(path(), 4096)


@needs_root
def test_a_private_directory_of_another_user_is_refused(shm):
    os.mkdir(naming.arena_dir(), 0o700)
    os.chown(naming.arena_dir(), OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeShmError, match=f"belongs to uid {OTHER_UID}"):
        Arena.create(path(), 4096)
    assert os.listdir(naming.arena_dir()) == []


@needs_root
def test_a_private_directory_planted_in_a_sticky_tmpfs_names_memsnap_shm_dir_first(shm, tmp_path, monkeypatch):
    os.chmod(shm, 0o1777)  # like /dev/shm: only an entry's owner (or root) may remove it
    os.mkdir(naming.arena_dir(), 0o700)
    os.chown(naming.arena_dir(), OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeShmError) as info:
        Arena.create(path(), 4096)
    message = str(info.value)
    assert message.startswith("set MEMSNAP_SHM_DIR=") and "\n" not in message
    assert f"belongs to uid {OTHER_UID}" in message and f"in the sticky {shm} only uid {OTHER_UID}" in message
    with pytest.raises(UnsafeShmError, match="^set MEMSNAP_SHM_DIR="):
        sweep()
    mine = tmp_path / "mine"  # the fix the message names works
    mine.mkdir()
    monkeypatch.setenv("MEMSNAP_SHM_DIR", str(mine))
    Arena.create(path(), 4096).close()
    assert os.listdir(mine) == []


# --- files planted at an arena's name ----------------------------------------------------------
def test_a_planted_symlink_is_not_followed(shm, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.mkdir(naming.arena_dir(), 0o700)
    os.symlink(victim, path())
    try:
        with pytest.raises(UnsafeShmError, match="symlink; it is not followed"):
            Arena.create(path(), 4096)
        assert victim.read_bytes() == b"precious" and os.path.islink(path())
    finally:
        os.unlink(path())
        shmdir.tidy()


@needs_root
def test_another_users_file_is_not_reused(shm):
    os.mkdir(naming.arena_dir(), 0o700)
    with open(path(), "wb") as f:
        f.write(b"theirs")
    os.chmod(path(), 0o666)
    os.chown(path(), OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeShmError, match=f"belongs to uid {OTHER_UID}"):
        Arena.create(path(), 4096)
    st = os.lstat(path())
    assert st.st_uid == OTHER_UID and st.st_size == 6  # untouched, and still not ours to read back
    os.unlink(path())


def test_a_file_other_users_may_read_is_not_reused(shm):
    os.mkdir(naming.arena_dir(), 0o700)
    with open(path(), "wb") as f:
        f.write(b"loose")
    os.chmod(path(), 0o666)
    with pytest.raises(UnsafeShmError, match="mode 0666"):
        Arena.create(path(), 4096)
    os.unlink(path())


def test_a_stale_file_of_a_dead_owner_is_replaced_but_a_live_one_is_not(shm):
    dead = python(
        f"from memsnap.memory.arena import Arena; Arena.create({path()!r}, 4096).view()[:4] = b'old!'; import os; os._exit(0)"
    )
    assert dead.returncode == 0, dead.stderr
    arena = Arena.create(path(), 8192)  # its creator is gone: replaced
    try:
        assert bytes(arena.view(0, 4)) == bytes(4) and os.path.getsize(path()) == 8192
        with pytest.raises(MemsnapError, match="held by a live process"):
            Arena.create(path(), 4096)
        assert bytes(arena.view(0, 4)) == bytes(4) and os.path.getsize(path()) == 8192
    finally:
        arena.close()


def test_attach_refuses_a_symlink(shm):
    arena = Arena.create(path(), 4096)
    link = path(rank=9)
    os.symlink(path(), link)
    try:
        with pytest.raises(UnsafeShmError, match="symlink"):
            Arena.attach(link, 4096)
    finally:
        os.unlink(link)
        arena.close()


@needs_root
def test_attach_refuses_another_users_file(shm):
    arena = Arena.create(path(), 4096)
    try:
        os.chown(path(), OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeShmError, match=f"belongs to uid {OTHER_UID}"):
            Arena.attach(path(), 4096)
    finally:
        arena.close()


# --- the sweep of dead agents' arenas; exact job names ---------------------------------------------
def test_sweep_removes_a_dead_agents_arenas_and_keeps_live_ones(shm):
    dead, live, mine = path("dead"), path("live"), path("mine")
    out = python(f"from memsnap.memory.arena import Arena; Arena.create({dead!r}, 4096); import os; os._exit(0)")
    assert out.returncode == 0, out.stderr
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys
        from memsnap.memory.arena import Arena
        arena = Arena.create({live!r}, 4096)
        print("ready", flush=True)
        sys.stdin.read()  # alive until the test closes our stdin
    """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    own = Arena.create(mine, 4096)
    try:
        assert agent.stdout.readline() == "ready\n"
        assert sweep() == [dead]
        assert os.path.exists(live) and os.path.exists(mine)
        agent.stdin.close()
        assert agent.wait() == 0
        assert sweep() == [live]
        assert os.path.exists(mine)
    finally:
        agent.kill()
        agent.wait()
        own.close()
    assert sweep() == [] and os.listdir(shm) == []


@pytest.mark.parametrize("job", ["train\n", "train\r\n", "a/b", "", "x" * 65, "-x"])
def test_a_job_name_is_matched_whole(job):
    with pytest.raises(ConfigError, match="job="):
        SnapshotConfig(job)
    assert SnapshotConfig("train").job == "train"


def test_only_a_whole_arena_name_is_an_arena():
    name = os.path.basename(path("train"))
    assert naming.parse_arena(name)["job"] == "train"
    assert naming.parse_arena(name + "\n") is None and naming.parse_arena(name + "x") is None


def test_arena_files_match_the_job_exactly(shm):
    arenas = [
        Arena.create(path(job, node), 4096)
        for job, node in [("bar", "n1"), ("bar", "n2"), ("bar-runtime", "n1"), ("foo-bar", "n1")]
    ]
    try:
        assert shmdir.arena_files("bar") == [path("bar", "n1"), path("bar", "n2")]
        assert shmdir.arena_files("bar", "n2") == [path("bar", "n2")]
        assert shmdir.arena_files("bar-runtime") == [path("bar-runtime", "n1")]
        assert shmdir.arena_files("ba") == [] and shmdir.arena_files("runtime") == []
        assert naming.parse_arena(os.path.basename(path("bar-runtime", "n1"))) == {
            "job": "bar-runtime",
            "node": "n1",
            "rank": 0,
            "slot": "0",
            "gen": 0,
        }
        assert shmdir.remove_job("bar") == [path("bar", "n1"), path("bar", "n2")]
        assert sorted(os.listdir(naming.arena_dir())) == sorted(
            os.path.basename(path(j, "n1")) for j in ("bar-runtime", "foo-bar")
        )
    finally:
        for arena in arenas:
            arena.close()
    assert os.listdir(shm) == []
