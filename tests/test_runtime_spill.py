"""The spill thread without Ray: throttled writes from the arena, failures reported and retried."""

from __future__ import annotations

import threading
import types
import uuid

import pytest

from memsnap import naming
from memsnap.config import SnapshotConfig
from memsnap.durable.storage import Store
from memsnap.localcluster import wait_for
from memsnap.memory.arena import Arena
from memsnap.node.agent import Version
from memsnap.node.spill import Spiller
from memsnap.state.capture import capture


@pytest.fixture
def fake_core(tmp_path):
    """The parts of an AgentCore the spill thread reads: one committed version of one rank."""
    import torch

    state = {"model": torch.nn.Linear(64, 64)}
    man, raw = capture(state)
    arena = Arena.create(naming.arena_path(f"test-spill-{uuid.uuid4().hex[:8]}", "n0", 0, 0, 0), man.nbytes)
    arena.view(0, man.nbytes)[:] = raw
    core = types.SimpleNamespace(
        node="n0",
        lock=threading.RLock(),
        arenas={(0, 0): arena},
        versions={7: Version(7, 0, "committed", {0: man.nbytes}, {0: man.to_json().decode()})},
    )
    yield core, state, bytes(raw)
    arena.close()


def test_a_failing_spill_is_reported_retried_and_leaves_ram_alone(tmp_path, fake_core, monkeypatch):
    monkeypatch.setenv("MEMSNAP_SPILL_RETRY_S", "0.05")
    core, _, raw = fake_core
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the spill root's parent is a file: every write fails
    core.cfg = SnapshotConfig("spill-unit", spill=str(blocker / "root"), spill_every=1)
    reported = []
    sp = Spiller.of(core, report=lambda step, ranks: reported.append((step, ranks)))
    try:
        sp.committed(7, due=True)
        wait_for(lambda: sp.status()["failures"] >= 2, timeout=30, what="two failed attempts")
        assert "step 7" in sp.status()["last_error"] and not reported
        assert bytes(core.arenas[(0, 0)].view()) == raw  # the RAM tier is untouched
        blocker.unlink()  # the disk is fixed: the next retry succeeds
        wait_for(lambda: reported, timeout=30, what="the retried spill")
    finally:
        sp.stop()
    assert reported == [(7, [0])] and sp.status()["spilled_step"] == 7


def test_spilled_bytes_load_back_through_the_durable_format(tmp_path, fake_core):
    from memsnap.state.apply import apply

    core, state, _ = fake_core
    core.cfg = SnapshotConfig("spill-unit", spill=str(tmp_path / "root"), spill_every=1)
    sp = Spiller.of(core, report=lambda step, ranks: Store.open(str(tmp_path / "root")).commit(step, 1))
    try:
        sp.committed(7, due=True)
        wait_for(lambda: sp.status()["spilled_step"] == 7, timeout=30, what="the spill")
    finally:
        sp.stop()
    store = Store.open(str(tmp_path / "root"))
    assert store.latest() == 7
    import torch

    fresh = {"model": torch.nn.Linear(64, 64)}
    man = store.manifest(7, 0)
    buf = bytearray(man.nbytes)
    store.read_rank_into(7, 0, buf)
    apply(fresh, man, buf, verify=True, rng=False)
    assert torch.equal(fresh["model"].weight, state["model"].weight)


def test_the_coordinator_asks_for_a_spill_every_n_steps_or_seconds(monkeypatch):
    from memsnap.job import commit
    from memsnap.job.commit import CommitLog

    steps = CommitLog(SnapshotConfig("spill-unit", spill="/tmp/unused", spill_every=3))
    # step 6 never committed: the spill moves to 7, the first commit of its block, not to 9
    assert [s for s in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10) if steps._spill_due(s)] == [0, 3, 7, 9]
    now = [100.0]
    monkeypatch.setattr(commit.time, "monotonic", lambda: now[0])
    secs = CommitLog(SnapshotConfig("spill-unit", spill="/tmp/unused", spill_every_seconds=10))
    due = []
    for step in range(8):
        due.append(secs._spill_due(step))
        now[0] += 4.0
    assert due == [True, False, False, True, False, False, True, False]
    never = CommitLog(SnapshotConfig("spill-unit"))
    assert not any(never._spill_due(s) for s in range(5))


def test_a_commit_the_coordinator_did_not_ask_to_spill_is_not_written(tmp_path, fake_core):
    core, _, _ = fake_core
    core.cfg = SnapshotConfig("spill-unit", spill=str(tmp_path / "root"), spill_every=1)
    sp = Spiller.of(core, report=lambda *a: None)
    try:
        sp.committed(7, due=False)
        assert sp.status()["pending"] is None and sp.status()["spilled_step"] is None
    finally:
        sp.stop()
