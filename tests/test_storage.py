"""The step-directory format: write/commit/read, visibility, corruption, ENOSPC, retention."""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from memsnap import storage
from memsnap.checksum import checksum
from memsnap.errors import ChecksumError, SnapshotNotFoundError, StorageError
from memsnap.manifest import Manifest, TensorEntry, align_up
from memsnap.storage import Retention, Store


def make_snapshot(seed: int, n: int = 1000) -> tuple[Manifest, bytearray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.integers(0, 1 << 30, size=7, dtype=np.int64)
    off_b = align_up(a.nbytes)
    buf = bytearray(align_up(off_b + b.nbytes))
    buf[: a.nbytes] = a.tobytes()
    buf[off_b: off_b + b.nbytes] = b.tobytes()
    tensors = [
        TensorEntry("w", "float32", (n,), 0, a.nbytes, checksum(a)),
        TensorEntry("b", "int64", (7,), off_b, b.nbytes, checksum(b)),
    ]
    return Manifest(tensors, {"w": {"__tensor__": 0}, "b": {"__tensor__": 1}}, len(buf)), buf


def save_step(store: Store, step: int, world: int = 1, meta: dict | None = None) -> list[bytearray]:
    bufs = []
    for rank in range(world):
        m, buf = make_snapshot(step * 10 + rank)
        store.write_rank(step, rank, m, buf)
        bufs.append(buf)
    store.commit(step, world, meta or {"step": step})
    return bufs


def test_roundtrip_two_ranks(tmp_path):
    store = Store.open(str(tmp_path))
    bufs = save_step(store, 5, world=2)
    assert store.steps() == [5]
    marker = store.marker(5)
    assert marker["world_size"] == 2 and marker["metadata"] == {"step": 5}
    for rank in range(2):
        m = store.manifest(5, rank, marker)
        out = bytearray(m.nbytes)
        store.read_rank_into(5, rank, out, marker=marker)
        assert out == bufs[rank]
        assert m.entry("b").checksum == make_snapshot(5 * 10 + rank)[0].entry("b").checksum


def test_file_uri_and_range_read(tmp_path):
    store = Store.open(f"file://{tmp_path}")
    [buf] = save_step(store, 1)
    out = bytearray(100)
    store.read_range(1, 0, 64, out)
    assert out == buf[64:164]


def test_uncommitted_step_is_invisible(tmp_path):
    store = Store.open(str(tmp_path))
    save_step(store, 1)
    m, buf = make_snapshot(2)
    store.write_rank(2, 0, m, buf)  # rank files written, no marker yet
    assert store.steps() == [1] and store.latest() == 1
    with pytest.raises(SnapshotNotFoundError, match="step 2 is not committed"):
        store.marker(2)


def test_empty_root_raises_clear_error(tmp_path):
    with pytest.raises(SnapshotNotFoundError, match="no committed step under"):
        Store.open(str(tmp_path / "nothing")).latest()


def test_commit_before_all_ranks_refused(tmp_path):
    store = Store.open(str(tmp_path))
    m, buf = make_snapshot(0)
    store.write_rank(3, 0, m, buf)
    with pytest.raises(StorageError, match="rank 1 has not written"):
        store.commit(3, 2)
    assert store.steps() == []


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_data_file_named(tmp_path, damage):
    store = Store.open(str(tmp_path))
    save_step(store, 7)
    path = store.path(7, "rank_00000.bin")
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[10] ^= 0xFF
    else:
        raw = raw[:-64]
    open(path, "wb").write(raw)
    m = store.manifest(7, 0)
    with pytest.raises(ChecksumError, match="rank_00000.bin"):
        store.read_rank_into(7, 0, bytearray(m.nbytes))


def test_corrupted_manifest_named(tmp_path):
    store = Store.open(str(tmp_path))
    save_step(store, 7)
    path = store.path(7, "rank_00000.json")
    raw = open(path, "rb").read().replace(b'"float32"', b'"float64"')
    open(path, "wb").write(raw)
    with pytest.raises(ChecksumError, match="rank_00000.json is corrupted"):
        store.manifest(7, 0)


def test_enospc_mid_file_leaves_previous_step(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path))
    [good] = save_step(store, 1)
    monkeypatch.setattr(storage, "IO_CHUNK", 1024)
    real, calls = storage._write_all, []

    def full_disk(fd, mv):
        calls.append(mv.nbytes)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, mv)

    monkeypatch.setattr(storage, "_write_all", full_disk)
    m, buf = make_snapshot(2)
    with pytest.raises(StorageError, match="No space left on device") as info:
        store.write_rank(2, 0, m, buf)
    assert "rank_00000.bin" in str(info.value) and isinstance(info.value, OSError)
    assert os.listdir(store.path(2)) == []  # neither the .tmp nor a partial file remains
    assert store.steps() == [1]
    out = bytearray(store.manifest(1, 0).nbytes)
    store.read_rank_into(1, 0, out)
    assert out == good


def test_progress_and_throttle(tmp_path, monkeypatch):
    clock = {"now": 0.0, "slept": 0.0}

    def sleep(s):
        clock["slept"] += s
        clock["now"] += s

    monkeypatch.setattr(storage.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(storage.time, "sleep", sleep)
    monkeypatch.setattr(storage, "IO_CHUNK", 1024)
    store = Store.open(str(tmp_path))
    m, buf = make_snapshot(1)
    seen = []
    store.write_rank(1, 0, m, buf, throttle_bps=2048, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (len(buf), len(buf)) and len(seen) == -(-len(buf) // 1024)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert clock["slept"] == pytest.approx(len(buf) / 2048)  # virtual clock: bytes / cap


def test_throttle_rejects_bad_cap(tmp_path):
    m, buf = make_snapshot(1)
    with pytest.raises(ValueError, match="throttle_bps=0"):
        Store.open(str(tmp_path)).write_rank(1, 0, m, buf, throttle_bps=0)


def test_retention_keeps_last_and_milestones(tmp_path):
    store = Store.open(str(tmp_path))
    for step in range(1, 11):
        save_step(store, step, meta={"milestone": step == 3})
    m, buf = make_snapshot(0)
    store.write_rank(4, 0, m, buf)  # debris of a crashed re-save
    deleted = store.retain(Retention(keep_last=2, milestone_every=5))
    assert store.steps() == [3, 5, 9, 10]
    assert deleted == [1, 2, 4, 6, 7, 8]
    assert not os.path.exists(store.path(4))


def test_retention_never_touches_newer_uncommitted(tmp_path):
    store = Store.open(str(tmp_path))
    save_step(store, 1)
    m, buf = make_snapshot(0)
    store.write_rank(2, 0, m, buf)  # a save in progress
    store.retain(Retention(keep_last=1))
    assert os.path.exists(store.path(2, "rank_00000.bin"))


def test_retention_validates():
    with pytest.raises(ValueError, match="keep_last=0"):
        Retention(keep_last=0)


def test_marker_is_json_with_ranks(tmp_path):
    store = Store.open(str(tmp_path))
    save_step(store, 2, world=3)
    doc = json.loads(open(store.path(2, "COMMITTED")).read())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2]
    assert all(r["bin_bytes"] == os.path.getsize(store.path(2, f"rank_{r['rank']:05d}.bin"))
               for r in doc["ranks"])
    assert not [f for f in os.listdir(store.path(2)) if f.endswith(".tmp")]


def test_two_writers_of_one_rank_file_use_their_own_temporary_files(tmp_path, monkeypatch):
    """A second writer of the same step and rank that runs while the first is mid-file (here:
    re-entered from the first's second chunk) neither truncates nor renames the first's file."""
    store = Store.open(str(tmp_path))
    monkeypatch.setattr(storage, "IO_CHUNK", 1024)
    real, seen = storage._write_all, []
    (m1, buf1), (m2, buf2) = make_snapshot(1), make_snapshot(2)

    def interleaved(fd, mv):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd, mv)
        if len(seen) == 2:  # writer 1 is mid-file: writer 2 writes the same rank whole
            store.write_rank(5, 0, m2, buf2)

    monkeypatch.setattr(storage, "_write_all", interleaved)
    record = store.write_rank(5, 0, m1, buf1)
    temps = {os.path.basename(p) for p in seen}
    assert all(t.startswith("rank_00000.") and t.endswith(".tmp") for t in temps)
    assert len({t for t in temps if t.startswith("rank_00000.bin.")}) == 2  # one of its own each
    store.commit(5, 1)
    out = bytearray(m1.nbytes)
    store.read_rank_into(5, 0, out)  # the last rename wins, whole and matching its checksum
    assert out == buf1 and record.bin_bytes == m1.nbytes
    assert sorted(os.listdir(store.path(5))) == ["COMMITTED", "rank_00000.bin", "rank_00000.json"]


def test_a_symlink_at_a_temporary_name_is_not_followed(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    bin_path = store.path(3, "rank_00000.bin")
    os.makedirs(store.path(3))
    planted = bin_path + ".planted.tmp"
    os.symlink(victim, planted)
    names = iter([planted, bin_path + ".fresh.tmp"])
    monkeypatch.setattr(storage, "tmp_name", lambda path: next(names) if path == bin_path else path + ".j.tmp")
    m, buf = make_snapshot(3)
    store.write_rank(3, 0, m, buf)
    assert victim.read_bytes() == b"precious" and os.path.islink(planted)  # passed over, not followed
    assert open(bin_path, "rb").read() == bytes(buf[: m.nbytes])
    assert not os.path.exists(bin_path + ".fresh.tmp")


def test_temporary_names_differ_per_write(tmp_path):
    names = {storage.tmp_name(str(tmp_path / "rank_00000.bin")) for _ in range(100)}
    assert len(names) == 100 and all(f".{os.getpid()}." in n for n in names)
