"""The step-directory format: write/commit/read, visibility, corruption, ENOSPC, retention."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.snapshots import make_snapshot, save_step

from memsnap.durable import localfs, storage
from memsnap.durable.storage import Retention, Store
from memsnap.errors import ChecksumError, FormatError, SnapshotNotFoundError, StorageError


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
    monkeypatch.setattr(localfs, "IO_CHUNK", 1024)
    real, calls = localfs.write_all, []

    def full_disk(fd, mv):
        calls.append(mv.nbytes)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, mv)

    monkeypatch.setattr(localfs, "write_all", full_disk)
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

    monkeypatch.setattr(localfs.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(localfs.time, "sleep", sleep)
    monkeypatch.setattr(localfs, "IO_CHUNK", 1024)
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
    assert all(r["bin_bytes"] == os.path.getsize(store.path(2, f"rank_{r['rank']:05d}.bin")) for r in doc["ranks"])
    assert not [f for f in os.listdir(store.path(2)) if f.endswith(".tmp")]


def test_two_writers_of_one_rank_file_use_their_own_temporary_files(tmp_path, monkeypatch):
    """A second writer of the same step and rank that runs while the first is mid-file (here:
    re-entered from the first's second chunk) neither truncates nor renames the first's file."""
    store = Store.open(str(tmp_path))
    monkeypatch.setattr(localfs, "IO_CHUNK", 1024)
    real, seen = localfs.write_all, []
    (m1, buf1), (m2, buf2) = make_snapshot(1), make_snapshot(2)

    def interleaved(fd, mv):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd, mv)
        if len(seen) == 2:  # writer 1 is mid-file: writer 2 writes the same rank whole
            store.write_rank(5, 0, m2, buf2)

    monkeypatch.setattr(localfs, "write_all", interleaved)
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
    monkeypatch.setattr(localfs, "tmp_name", lambda path: next(names) if path == bin_path else path + ".j.tmp")
    m, buf = make_snapshot(3)
    store.write_rank(3, 0, m, buf)
    assert victim.read_bytes() == b"precious" and os.path.islink(planted)  # passed over, not followed
    assert open(bin_path, "rb").read() == bytes(buf[: m.nbytes])
    assert not os.path.exists(bin_path + ".fresh.tmp")


def test_temporary_names_differ_per_write(tmp_path):
    names = {localfs.tmp_name(str(tmp_path / "rank_00000.bin")) for _ in range(100)}
    assert len(names) == 100 and all(f".{os.getpid()}." in n for n in names)


@pytest.fixture
def new_process(monkeypatch):
    """A function that makes this process look like a fresh one to the store: no record of
    what it resumed from, committed, read or warned about."""

    def fresh() -> None:
        monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
        monkeypatch.setattr(storage, "_HISTORY", {}, raising=False)
        monkeypatch.setattr(storage, "_WARNED", set(), raising=False)

    return fresh


def read_back(store: Store, step: int, rank: int = 0) -> bytearray:
    marker = store.marker(step)
    out = bytearray(store.manifest(step, rank, marker).nbytes)
    store.read_rank_into(step, rank, out, marker=marker)
    return out


def test_rollback_keeps_the_new_lineage_and_the_step_it_resumed_from(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    save_step(store, 100)
    save_step(store, 200)
    store.resumed(100)  # a run rolled back to step 100 (what load(step=100) records)
    with pytest.warns(
        UserWarning,
        match="saving step 110 behind newer committed step 200 of another "
        "lineage.*load.step=None. will resume this lineage",
    ):
        save_step(store, 110)
    assert store.retain(Retention(keep_last=2)) == []  # 200 stays until this lineage holds 2 steps
    assert store.steps() == [100, 110, 200] and store.latest() == 110
    save_step(store, 120)
    assert store.retain(Retention(keep_last=2)) == [200]
    assert store.steps() == [100, 110, 120]
    new_process()  # a crash: the next process resumes the new lineage, not step 200
    assert Store.open(str(tmp_path)).latest() == 120
    assert Store.open(str(tmp_path)).resume_order() == [120, 110, 100]
    save_step(Store.open(str(tmp_path)), 130)
    assert Store.open(str(tmp_path)).retain(Retention(keep_last=2)) == [110]
    assert store.steps() == [100, 120, 130]  # the step the lineage resumed from stays


def test_rollback_with_keep_last_1_keeps_each_new_save(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    save_step(store, 100)
    save_step(store, 200)
    store.resumed(100)
    for step in (110, 120):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_step(store, step)
        store.retain(Retention(keep_last=1))
        assert store.steps() == [100, step] and store.latest() == step


def test_lineage_is_recorded_in_the_marker(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    save_step(store, 1)
    save_step(store, 2)
    store.resumed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_step(store, 3)
    first, second, third = (store.marker(s)["lineage"] for s in (1, 2, 3))
    assert first["parent"] is None and first["base"] is None and second["parent"] == 1
    assert first["id"] == second["id"] != third["id"]
    assert (third["parent"], third["base"]) == (1, 1)
    assert first["seq"] < second["seq"] < third["seq"]


def test_markers_without_lineage_are_one_lineage_by_step(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    for step in (1, 2, 3):
        save_step(store, step)
        path = store.path(step, "COMMITTED")
        doc = json.loads(open(path).read())
        del doc["lineage"]
        doc["written_by"] = "a later memsnap"  # unknown keys are ignored
        with open(path, "w") as f:
            json.dump(doc, f)
    new_process()
    store = Store.open(str(tmp_path))
    assert store.latest() == 3 and store.resume_order() == [3, 2, 1]
    assert read_back(store, 3) == make_snapshot(30)[1]
    save_step(store, 4)
    assert store.marker(4)["lineage"]["parent"] == 3
    assert store.retain(Retention(keep_last=2)) == [1, 2]


def test_resave_replaces_a_committed_step_in_one_marker_write(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    [old] = save_step(store, 5, world=2)[:1]
    m, new = make_snapshot(77)
    store.write_rank(5, 0, m, new)  # a re-save of step 5, not committed yet (a crash here)
    assert read_back(Store.open(str(tmp_path)), 5) == old  # the committed step is untouched
    store.commit(5, 1)
    assert read_back(Store.open(str(tmp_path)), 5) == new
    tag = store.marker(5)["files"]
    assert sorted(os.listdir(store.path(5))) == ["COMMITTED", f"rank_00000.{tag}.bin", f"rank_00000.{tag}.json"]
    out = bytearray(16)
    Store.open(str(tmp_path)).read_range(5, 0, 0, out)
    assert out == new[:16]


def test_a_marker_naming_files_outside_its_step_is_refused(tmp_path, new_process):
    new_process()
    store = Store.open(str(tmp_path))
    save_step(store, 5)
    path = store.path(5, "COMMITTED")
    doc = json.loads(open(path).read())
    doc["files"] = "../../elsewhere"
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(FormatError, match="files: must be 'r' and 16 hex digits"):
        Store.open(str(tmp_path)).marker(5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keep=st.integers(1, 3),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("save"), st.integers(1, 3)),
            st.tuples(st.just("rollback"), st.integers(0, 1 << 16)),
            st.tuples(st.just("crash"), st.just(0)),
        ),
        max_size=14,
    ),
)
def test_retention_and_resume_follow_the_newest_run(keep, ops, new_process):
    """Random saves, rollbacks to a committed step and crashes (a fresh process): the newest
    save is what a fresh process resumes, the newest ``keep`` saves of the run since its last
    rollback and the step it rolled back to stay, and every committed step reads back as the
    last save of its number."""
    new_process()
    with tempfile.TemporaryDirectory() as root:
        store, saved, at, last, run, base, seed = Store.open(root), {}, 0, None, [], None, 0
        for op, arg in ops:
            if op == "rollback" and store.steps():
                at = store.steps()[arg % len(store.steps())]
                store.resumed(at)
                if at != last:  # resuming from the newest commit goes on with the same run
                    run, base = [], at
            elif op == "crash":
                new_process()
                store = Store.open(root)
                at = last or 0
            elif op == "save":
                seed, at, last = seed + 1, at + arg, at + arg
                m, buf = make_snapshot(seed)
                store.write_rank(at, 0, m, buf)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    store.commit(at, 1)
                store.retain(Retention(keep_last=keep))
                saved[at], run = buf, run + [at]
                committed = set(store.steps())
                assert store.latest() == at
                assert set(run[-keep:]) <= committed
                assert base is None or base in committed
                assert all(read_back(store, s) == saved[s] for s in committed)
        new_process()
        if saved:
            assert Store.open(root).resume_order()[0] == last


def test_names_are_matched_whole_a_trailing_newline_is_not_a_step_or_a_rank_file(tmp_path):
    store = Store.open(str(tmp_path))
    save_step(store, 5)
    # a planted directory that differs from a step's name only by a trailing newline
    os.rename(store.path(5), os.path.join(str(tmp_path), "step_000000000005\n"))
    assert store.steps() == []
    with pytest.raises(SnapshotNotFoundError):
        store.latest()
