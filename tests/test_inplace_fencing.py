"""Fencing (no Ray): ``CoordinatorCore.node_lost`` is memsnap's own verdict that a node is
lost. The fenced node leaves the live nodes at once (before Ray says anything), its phase-one
reports are ignored, it cannot join again, a standby taking its rank on a placed spare node
makes the placement drop it, and a second verdict on it (Ray's, later) changes nothing."""

from __future__ import annotations

import pytest
from support.directory import NODES, Nodes, address

from memsnap.coding.stripes import stripes_of
from memsnap.config import SnapshotConfig
from memsnap.errors import CommitError
from memsnap.job.coordinator import CoordinatorCore
from memsnap.records import Inventory, NodeReady, Region

A, B, C, D, E = NODES  # ranks 0, 1, 2 on A, B, C; D and E are spares


@pytest.fixture
def core():
    core = CoordinatorCore(SnapshotConfig("fencing", k=2, m=1).to_dict(), 3, directory=Nodes())
    core.sent = []
    core.broadcast = lambda *args: core.sent.append(args[0])
    for rank, node in enumerate([A, B, C]):
        core.join(node, address(node), [rank], 3)
    assert core.membership.peered and set(core.membership.placement.holders) == set(NODES)
    core.sent.clear()
    return core


def ready(core, step: int, node: str, rank: int) -> dict:
    holders = core.membership.placement.holders[node]
    return NodeReady(step, node, 0, 4096, (Region(rank, 4096, 0),), holders, world=3).to_wire()


def placed_anywhere(core, node: str) -> bool:
    holders = core.membership.placement.holders
    return node in holders or any(node in h for h in holders.values())


def test_a_fenced_node_leaves_the_live_nodes_at_once_while_ray_still_sees_it(core):
    assert core.node_lost(B, "rank 1: no heartbeat for 1.2 s") is True
    assert B in core.dir.alive()  # Ray has not noticed anything yet
    assert B not in core._alive() and core._alive() == {A, C, D, E}
    assert core.dir.forgotten == [B]  # its agent's handle is never used again
    assert B not in core.membership.live_nodes()


def test_the_steps_in_flight_a_lost_node_never_reported_fail_so_their_slots_are_freed(core):
    """A and C sent step 5 and 6; B was lost before it reported either (its ranks' bytes are gone
    with it): both fail at once, and every agent is told to drop them. Nothing else would end
    them (a newer step cannot commit while they hold the agents' slots)."""
    core.node_ready(ready(core, 4, B, 1))  # B reported 4 before it was lost: 4 waits on A and C
    for step in (5, 6):
        for rank, node in ((0, A), (2, C)):
            core.node_ready(ready(core, step, node, rank))
    assert sorted(core.log.pending) == [4, 5, 6]
    core.sent.clear()
    assert core.node_lost(B, "rank 1: its process ended") is True
    assert sorted(core.log.failed) == [5, 6] and "node" in core.log.failed[5] and "is lost" in core.log.failed[5]
    assert sorted(core.log.pending) == [4] and core.sent.count("abandon") == 2
    assert core.node_lost(B, "Ray declared it dead") is False and core.sent.count("abandon") == 2
    core.join(D, address(D), [1], 3)  # the standby takes rank 1; the job goes on at step 7
    for rank, node in enumerate([A, D, C]):
        core.node_ready(ready(core, 7, node, rank))
    assert core.newest() == 7


def test_a_lost_spare_fails_no_step_in_flight(core):
    core.node_ready(ready(core, 5, A, 0))
    assert core.node_lost(E, "its agent stopped answering") is True  # a spare never reports a step
    assert 5 in core.log.pending and not core.log.failed


def test_a_fenced_nodes_report_is_ignored_so_a_step_never_commits_because_of_it(core):
    core.node_lost(B, "rank 1: its process ended")
    for rank, node in enumerate([A, B, C]):
        core.node_ready(ready(core, 5, node, rank))
    assert core.newest() is None  # A and C alone are not every node running ranks
    assert B not in core.log.pending.get(5, {})
    core.join(D, address(D), [1], 3)  # the standby on D takes rank 1
    core.node_ready(ready(core, 5, D, 1))
    assert core.newest() == 5
    assert set(core.log.records[5].nodes) == {A, C, D}


def test_a_join_from_a_fenced_node_is_refused_and_changes_nothing(core):
    core.node_lost(B, "rank 1: no heartbeat for 1.2 s")
    core.join(D, address(D), [1], 3)  # the standby took rank 1
    holders, members = dict(core.membership.holders), dict(core.membership.members)
    membership, epoch, run = core.membership, core.membership.epoch, core.run
    claim = {1: {"run": None, "process": "4242-17"}}  # the frozen process woke up
    with pytest.raises(CommitError, match=r"node bbbbbbbbbbbb was declared lost and is fenced"):
        core.join(B, address(B), [1], 3, claim)
    assert core.membership.holders == holders  # the standby still holds rank 1
    with pytest.raises(CommitError, match=r"fenced"):
        core.join(B, address(B), [1], 4, claim)  # not even as an elastic restart
    assert core.membership is membership and core.world == 3 and core.membership.epoch == epoch
    assert core.membership.holders == holders and core.membership.members == members
    assert core.run == run and core.membership.holders[1].node == D


def test_a_standby_on_a_placed_spare_taking_the_lost_rank_drops_the_lost_node_from_the_placement(core):
    epoch = core.membership.epoch
    assert core.node_lost(B, "rank 1: its process ended") is True
    assert placed_anywhere(core, B)  # it still runs rank 1 until a standby takes it
    assert core.membership.epoch == epoch and core.sent == []
    core.join(D, address(D), [1], 3)
    assert core.membership.members == {0: A, 1: D, 2: C}
    assert not placed_anywhere(core, B) and set(core.membership.placement.holders) == {A, C, D, E}
    assert core.membership.peered and core.membership.epoch > epoch
    assert core.sent == ["layout_changed"]  # every agent drops the layout that named B
    assert core.answer(D).ranks == (1,)


def test_a_fenced_spare_leaves_the_placement_at_once(core):
    epoch = core.membership.epoch
    assert core.node_lost(E, "its agent stopped answering") is True
    assert not placed_anywhere(core, E) and core.membership.epoch > epoch
    assert core.membership.peered and core.sent == ["layout_changed"]


def test_node_lost_twice_is_false_and_ray_declaring_the_node_dead_later_changes_nothing(core):
    assert core.node_lost(B, "rank 1: no heartbeat for 1.2 s") is True
    core.join(D, address(D), [1], 3)
    placement, epoch, sent = core.membership.placement, core.membership.epoch, list(core.sent)
    assert core.node_lost(B, "again") is False
    core.dir.up.discard(B)  # Ray's verdict, seconds later
    assert core.node_lost(B, "ray: node dead") is False
    assert core._alive() == {A, C, D, E} and core.dir.forgotten == [B]
    assert core.membership.placement is placement and core.membership.epoch == epoch and core.sent == sent


# --- a doubt: the lost node's verdict pending, the restore plan made without it -----------------


def commit(core, step: int) -> None:
    for rank, node in enumerate([A, B, C]):
        core.node_ready(ready(core, step, node, rank))
    assert core.newest() == step


def agents_holding(core, step: int, nodes, lost_pieces_of=None) -> list[list[str]]:
    """Every one of ``nodes``' agents answers ``inventory`` with its committed copy of ``step``
    and the pieces it holds of the others (none of ``lost_pieces_of``'s); returns the list of
    the node lists each call asked."""
    record, asked = core.log.records[step], []
    inventories = {}
    for node in nodes:
        held = {
            owner: {info.holders.index(node): stripes_of(info.regions, 2, info.chunk)}
            for owner, info in record.nodes.items()
            if node in info.holders and owner != lost_pieces_of
        }
        versions = {step: ("committed", tuple(record.ranks_of(node)))} if node in record.nodes else {}
        inventories[node] = Inventory(node, address(node), versions, {step: held}).to_wire()
    answer = core.dir.call_all

    def call_all(call_nodes, method, *args, timeout):
        if method != "inventory":
            return answer(call_nodes, method, *args, timeout=timeout)
        asked.append(sorted(call_nodes))
        return {n: inventories[n] for n in call_nodes if n in inventories}

    core.dir.call_all = call_all
    core._durable_step = lambda: None
    return asked


def restoring_with_b_doubted(core, lost_pieces_of=None) -> tuple[list[str], list[list[str]]]:
    """Step 5 committed; B doubted (its rank 1 lost); the standby on D takes rank 1 while B's
    verdict is pending; every agent would answer (``agents_holding``); every rank arrived in
    restore round 0. The nodes the doubt named, and the node lists the inventories asked."""
    commit(core, 5)
    doubted = core.doubt([B], "rank 1: its process ended")
    core.join(D, address(D), [1], 3)
    asked = agents_holding(core, 5, NODES, lost_pieces_of=lost_pieces_of)
    core.restore_arrive(0, [0, 1, 2])
    return doubted, asked


def test_a_doubted_node_is_not_asked_and_the_plan_is_made_at_once_when_the_others_hold_the_newest_step(core):
    doubted, asked = restoring_with_b_doubted(core)
    assert doubted == [B]
    plan = core.plan_early(0)
    assert plan is not None and plan.step == 5 and plan.plan == "ram"
    assert plan.ranks == {0: "local", 1: "peer", 2: "local"}  # rank 1 decoded from B's holders
    assert asked and all(B not in nodes for nodes in asked)
    assert core.status()["doubted"] == [B] and B in core._alive()  # not fenced, and still placed
    assert core.node_lost(B, "rank 1: its agent did not answer") is True
    assert core.doubted == {} and core.doubt([B], "again") == []  # fenced: never doubted again


def test_a_plan_the_doubted_node_could_better_waits_for_its_verdict_and_then_asks_it(core):
    # B's holders lost its pieces: only B's own copy of rank 1 can serve step 5 from RAM
    _, asked = restoring_with_b_doubted(core, lost_pieces_of=B)
    assert core.plan_early(0) is None  # without B the plan could not load step 5
    assert asked == [[A, C, D, E]] and core.rounds.rounds[0].plan is None
    assert core.cleared(B) is True  # its agent answered: a process was lost, not the node
    plan = core.plan(0)
    assert plan.step == 5 and plan.ranks == {0: "local", 1: "copy", 2: "local"}
    assert asked[-1] == [A, B, C, D, E]
    assert core.plan_early(0) is plan  # one plan per round


def test_a_late_plan_asks_a_node_still_doubted_when_its_verdict_never_came(core):
    _, asked = restoring_with_b_doubted(core, lost_pieces_of=B)
    assert core.plan_early(0) is None
    assert core.plan(0).ranks[1] == "copy" and B in asked[-1]  # (the actor waits doubt_wait_s first)
