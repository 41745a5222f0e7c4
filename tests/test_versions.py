"""A node's version table without Ray or arenas: every state move, the refused ones, which
version gives way under pressure, and what lean mode (``local_copy=False``) changes."""

from __future__ import annotations

import itertools

import pytest

from memsnap.config import SnapshotConfig
from memsnap.errors import CommitError, VersionStateError
from memsnap.node.versions import (
    ALLOWED,
    CAPTURING,
    COMMITTED,
    FAILED,
    QUEUED,
    READY,
    RESTORING,
    SENDING,
    SUPERSEDED,
    SlotPolicy,
    State,
    Version,
    Versions,
)

LOCAL, LEAN = SlotPolicy(local_copy=True), SlotPolicy(local_copy=False)
LEAN_SPILL = SlotPolicy(local_copy=False, spill=True)


def table(policy=LOCAL, slots=3, keep=2):
    replaced = []
    vs = Versions(policy, slots, keep, {}, lambda v, was, step: replaced.append((v.step, was, step)))
    return vs, replaced


def never(step):
    return False


def ready(vs, step, slot, ranks=(0,)):
    """``step`` captured by ``ranks`` into ``slot``, sent, every chunk acknowledged."""
    v = vs.begin(step, slot)
    for r in ranks:
        vs.add_rank(v, r, 64)
    assert all(vs.captured(v, r, "{}", ranks) == (r == ranks[-1]) for r in ranks)
    assert vs.sending(v) and vs.sent(v)
    return v


def commit(vs, step, slot, keep=None, spill=False, released=None):
    v = ready(vs, step, slot)
    vs.committed(step, set(keep or (step,)), spill, never, (released if released is not None else []).append)
    return v


# --- the states ---------------------------------------------------------------------------------
def test_a_state_is_its_string_and_a_version_takes_one_given_as_a_string():
    assert State.READY == "ready" and f"{State.READY}" == "ready" and str(State.COMMITTED) == "committed"
    assert {"ready": 1}[State.READY] == 1 and {State.READY: 1}["ready"] == 1
    assert "sending" in (SENDING, READY)
    v = Version(3, 0, "committed", {0: 8}, {0: "{}"})
    assert v.state is COMMITTED
    v.state = "ready"  # (tests set a state directly; it is still a State)
    assert v.state is READY
    with pytest.raises(ValueError):
        Version(3, 0, "freed")  # never a state


def test_every_allowed_move_is_taken_and_every_other_one_refused_naming_both_states():
    states = [None, *State]
    for was, to in itertools.product(states, State):
        vs, _ = table()
        v = Version(1, 0)
        object.__setattr__(v, "state", was)
        if to in ALLOWED[was]:
            vs._move(v, to)
            assert v.state is to
        else:
            with pytest.raises(VersionStateError, match=f"cannot become {to.value}"):
                vs._move(v, to)
            assert v.state is was
    assert isinstance(VersionStateError("x"), CommitError)
    assert ALLOWED[FAILED] == ALLOWED[SUPERSEDED] == frozenset()  # the ends


def test_a_snapshot_goes_capturing_queued_sending_ready_committed():
    vs, _ = table()
    v = vs.begin(5, 0, gen=2)
    assert (v.state, v.gen, vs[5]) == (CAPTURING, 2, v)
    vs.add_rank(v, 0, 64)
    vs.add_rank(v, 1, 64)
    assert not vs.captured(v, 0, "m0", [0, 1]) and v.state is CAPTURING  # rank 1 still writes
    assert vs.captured(v, 1, "m1", [0, 1]) and v.state is QUEUED
    assert vs.sending(v) and v.state is SENDING
    vs.checksummed(v, 0, "m0+sums")
    assert vs.sent(v) and v.state is READY and vs.in_flight_before(6)
    vs.committed(5, {5}, False, never, lambda v: pytest.fail("the local copy is kept"))
    assert v.state is COMMITTED and vs.holds(5, 0) and vs.committed_version(5) is v and not vs.in_flight_before(6)
    assert vs.summary() == {5: ("committed", (0, 1))} and vs.local_bytes() == 128
    assert v.manifests == {0: "m0+sums", 1: "m1"}
    with pytest.raises(VersionStateError, match="step 5 is already committed"):
        vs.begin(5, 1)


def test_a_capture_begun_again_voids_the_ranks_manifest_and_one_without_a_rank_is_withdrawn():
    vs, _ = table()
    v = vs.begin(1, 0)
    vs.withdraw(v)  # its arena did not fit
    assert 1 not in vs
    v = vs.begin(1, 0)
    vs.add_rank(v, 0, 64)
    vs.captured(v, 0, "old", [0, 1])
    vs.add_rank(v, 0, 64)
    vs.withdraw(v)  # it holds a rank: stays
    assert vs[1] is v and v.manifests == {}


def test_a_failure_is_counted_once_and_never_touches_a_committed_version():
    vs, _ = table()
    v = vs.begin(1, 0)
    vs.failed(v, "boom")
    vs.failed(v, "again")
    assert (v.state, v.error, vs.counters["failed_snapshots"]) == (FAILED, "boom", 1)
    assert not vs.sending(v) and not vs.sent(v)  # the sender finds it given up
    c = commit(vs, 2, 1)
    vs.failed(c, "late")
    assert c.state is COMMITTED and vs.counters["failed_snapshots"] == 1
    again = vs.begin(1, 2)  # a failed step may be captured again
    assert vs[1] is again and again.state is CAPTURING


def test_the_sender_finds_a_version_replaced_while_it_waited():
    vs, replaced = table(slots=1)
    old = vs.begin(1, 0)
    vs.add_rank(old, 0, 64)
    vs.captured(old, 0, "{}", [0])
    assert vs.free_slot(2, never) == 0  # the newest capture takes the slot of the queued one
    assert old.state is SUPERSEDED and old.error == "replaced by step 2" and 1 not in vs
    assert replaced == [(1, "not yet sent", 2)] and not vs.sending(old)
    assert vs.counters["failed_snapshots"] == 0  # not a failure


# --- which slot -----------------------------------------------------------------------------------
def test_newest_wins_but_a_sent_version_never_gives_way():
    vs, replaced = table(slots=3, keep=2)
    commit(vs, 1, 0, keep=(1,))
    ready(vs, 2, 1)
    v3 = vs.begin(3, 2)
    assert vs.free_slot(4, never) == 2 and replaced == [(3, "still capturing", 4)] and v3.state is SUPERSEDED
    v4 = vs.begin(4, 2)
    vs.add_rank(v4, 0, 64)
    assert vs.captured(v4, 0, "{}", [0]) and vs.sending(v4)
    assert vs.free_slot(5, never) is None  # 1 committed (one only: kept whole), 2 ready, 4 sending
    assert vs.busy() == [(1, "committed"), (2, "ready"), (4, "sending")] and not replaced[1:]
    assert all(type(state) is str for _, state in vs.busy())  # (it is printed in messages)


def test_committed_versions_beyond_keep_give_way_unless_the_spill_writes_them():
    vs, _ = table(slots=3, keep=2)
    for step in (1, 2, 3):
        commit(vs, step, step - 1, keep=(1, 2, 3))
    assert vs.free_slot(4, lambda s: s == 1) is None  # 1 is beyond keep but being spilled
    assert sorted(vs) == [1, 2, 3]
    assert vs.free_slot(4, never) == 0 and sorted(vs) == [2, 3]
    vs.failed(vs.begin(4, 0), "boom")
    assert vs.free_slot(5, never) == 0 and 4 not in vs  # a failed version is forgotten, its slot free


def test_with_two_committed_and_no_free_slot_the_oldest_gives_way():
    vs, _ = table(slots=2, keep=2)
    commit(vs, 1, 0, keep=(1,))
    commit(vs, 2, 1, keep=(1, 2))
    assert vs.free_slot(3, lambda s: s == 1) is None and sorted(vs) == [1, 2]
    assert vs.free_slot(3, never) == 0 and sorted(vs) == [2]


# --- what the coordinator decides -------------------------------------------------------------------
def test_a_commit_frees_older_steps_not_kept_and_gives_up_those_not_committed_uncounted():
    vs, _ = table(slots=4, keep=2)
    commit(vs, 1, 0, keep=(1,))
    sending = vs.begin(2, 1)
    vs.add_rank(sending, 0, 64)
    vs.captured(sending, 0, "{}", [0])
    vs.sending(sending)
    ready(vs, 3, 2)
    vs.committed(3, {3}, False, lambda s: s == 1, [].append)
    assert sorted(vs) == [1, 3] and vs[3].state is COMMITTED  # 1 is being spilled: it stays
    assert sending.state is FAILED and sending.error == "step 3 committed first"
    assert not vs.sent(sending) and vs.counters["failed_snapshots"] == 0  # overtaken, not failed
    q = vs.begin(4, 3)  # a step this node had not finished commits all the same
    vs.add_rank(q, 0, 64)
    vs.captured(q, 0, "{}", [0])
    vs.committed(4, {3, 4}, False, never, [].append)
    assert q.state is COMMITTED and sorted(vs) == [3, 4]


def test_abandoned_and_resumed_steps_are_freed():
    vs, _ = table(slots=4)
    c = commit(vs, 1, 0)
    for step in (2, 3, 4):
        vs.begin(step, step - 1)
    vs.abandoned(2, "a node skipped it", failed=False)
    vs.abandoned(1, "too late")  # committed: kept
    assert sorted(vs) == [1, 3, 4] and vs.counters["failed_snapshots"] == 0
    three = vs[3]
    vs.abandoned(3, "a holder died")
    assert three.state is FAILED and three.error == "abandoned: a holder died" and 3 not in vs
    vs.resumed(0, "the job resumed from step 0")
    assert sorted(vs) == [1] and c.state is COMMITTED and vs.counters["failed_snapshots"] == 2


def test_a_restore_gathers_into_a_restoring_version_that_commits():
    vs, _ = table()
    v = vs.restoring(7, 0)
    vs.restore_rank(v, 0, 64)
    vs.restore_rank(v, 1, 64)
    assert v.state is RESTORING and vs.busy() == [(7, "restoring")] and vs.free_slots() == [1, 2]
    vs.restored(v, 0, "m0")
    assert v.state is COMMITTED and vs.holds(7, 0) and not vs.holds(7, 1)
    vs.restored(v, 1, "m1")  # the node's second rank
    assert vs.holds(7, 1)
    gone = vs.restoring(8, 1)
    vs.resumed(7, "resumed")  # freed while its bytes came in
    vs.restored(gone, 0, "m")
    assert gone.state is FAILED and 8 not in vs


def test_a_rebuilt_local_copy_is_committed_and_a_rank_that_left_is_forgotten():
    vs, _ = table()
    v = vs.rebuilt(4, 1, gen=3)
    vs.add_copy(v, 0, 64, "m0")
    vs.add_copy(v, 1, 32, "m1")
    assert v.state is COMMITTED and v.gen == 3 and vs.holds(4, 1) and vs.local_bytes() == 96
    vs.forget_rank(1)
    assert v.sizes == {0: 64} and v.manifests == {0: "m0"}


# --- lean mode ------------------------------------------------------------------------------------
def test_the_slot_policy_of_each_mode():
    assert SlotPolicy.of(SnapshotConfig("j")) == LOCAL
    assert SlotPolicy.of(SnapshotConfig("j", local_copy=False)) == LEAN
    assert SlotPolicy.of(SnapshotConfig("j", local_copy=False, spill="/tmp/x")) == LEAN_SPILL
    holding = {p: {s for s in State if p.holds_slot(s)} for p in (LOCAL, LEAN, LEAN_SPILL)}
    live = {CAPTURING, QUEUED, SENDING, COMMITTED, RESTORING}
    assert holding == {LOCAL: live | {READY}, LEAN: live, LEAN_SPILL: live | {READY}}
    assert [p.keeps_committed(False) for p in (LOCAL, LEAN, LEAN_SPILL)] == [True, False, False]
    assert [p.keeps_committed(True) for p in (LOCAL, LEAN, LEAN_SPILL)] == [True, True, True]
    assert [p.holds_for_spill(True) for p in (LOCAL, LEAN, LEAN_SPILL)] == [False, True, True]
    assert [p.releases_when_sent for p in (LOCAL, LEAN, LEAN_SPILL)] == [False, True, False]
    assert [p.frees_when_spilled for p in (LOCAL, LEAN, LEAN_SPILL)] == [False, True, True]
    assert [p.keeps_restored for p in (LOCAL, LEAN)] == [True, False]
    assert [p.clears_for_restore for p in (LOCAL, LEAN)] == [False, True]


def test_lean_a_sent_version_frees_the_one_slot_and_its_commit_keeps_no_copy():
    vs, _ = table(LEAN, slots=1)
    v = ready(vs, 1, 0)
    assert vs.free_slots() == [0]  # its bytes are at its holders
    released = []
    vs.committed(1, {1}, False, never, released.append)
    assert v.state is COMMITTED and vs == {} and released == [v]
    local, _ = table(LOCAL)
    commit(local, 1, 0, released=released)
    assert local.holds(1, 0) and released == [v]


def test_lean_with_a_spill_holds_a_due_step_until_it_is_written():
    vs, _ = table(LEAN_SPILL, slots=2)
    v = ready(vs, 1, 0)
    assert vs.free_slots() == [1]  # a sent version keeps its slot until its commit says if it is due
    released = []
    vs.committed(1, {1}, True, never, released.append)
    assert vs.committed_version(1) is v and released == [] and vs.free_slots() == [1]
    w = ready(vs, 2, 1)
    vs.committed(2, {1, 2}, True, lambda s: s == 1, released.append)  # 1 is being written: stays
    assert sorted(vs) == [1, 2] and released == []
    assert vs.spilled(1) is v and sorted(vs) == [2]
    vs.committed(3, {2, 3}, True, never, released.append)  # (3 is not here) 2, held for its spill, gives way
    assert vs == {} and w.state is COMMITTED
    ready(vs, 4, 0)
    vs.committed(4, {4}, False, never, released.append)  # not due: freed at once
    assert vs == {} and [r.step for r in released] == [4]
    local, _ = table(SlotPolicy(local_copy=True, spill=True))
    commit(local, 1, 0, spill=True)
    assert local.spilled(1) is None and local.holds(1, 0)  # the local copy stays


def test_lean_a_restore_takes_the_slot_back_and_keeps_no_copy():
    vs, _ = table(LEAN, slots=1)
    ready(vs, 6, 0)
    q = vs.begin(7, 0)
    vs.add_rank(q, 0, 64)
    vs.captured(q, 0, "{}", [0])
    vs.clear_for_restore(6)
    assert vs == {} and vs.counters["failed_snapshots"] == 2 and vs.free_slot(6, never) == 0
    v = vs.restoring(6, 0)
    vs.restore_rank(v, 0, 64)
    vs.clear_for_restore(6)  # a second rank of the node: its restoring version stays
    assert vs[6] is v
    vs.restored(v, 0, "m")
    assert v.state is COMMITTED and vs == {} and vs.free_slots() == [0]
    local, _ = table(LOCAL)
    ready(local, 6, 0)
    local.clear_for_restore(6)
    assert sorted(local) == [6]


def test_no_other_part_of_the_agent_writes_the_version_table():
    """The table's one writer is ``Versions``: the agent's other modules move no state and
    add or drop no version themselves (a read such as ``v.state is FAILED`` is fine; a part's
    own ``self.state`` is its status, not a version's)."""
    import pathlib
    import re

    import memsnap

    root = pathlib.Path(memsnap.__file__).parent
    writes = re.compile(
        r"(?<!self)\.state\s*=(?!=)|versions\.pop\(|versions\[[^\]]*\]\s*=(?!=)"
        r"|\.(sizes|manifests)(\[[^\]]*\]\s*=(?!=)|\.pop\(|\.update\()"
    )
    found = []
    for name in (
        "node/agent.py",
        "node/slots.py",
        "node/sender.py",
        "node/repair.py",
        "node/spill.py",
        "node/relay.py",
        "device/runtime.py",
    ):
        for n, line in enumerate((root / name).read_text().splitlines(), 1):
            if writes.search(line):
                found.append(f"{name}:{n}: {line.strip()}")
    assert found == []
