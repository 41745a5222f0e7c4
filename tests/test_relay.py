"""The node relay from its parts: a node that is only what ``RelayedNode`` names, and a
scripted coordinator. A node's ranks reach the coordinator once per node, a node gives up
its steps above a round's plan before its ranks hear the plan, and a restore round that
succeeds resumes the node before any of its ranks hears the outcome."""

from __future__ import annotations

import asyncio

import pytest

from memsnap.errors import CommitError
from memsnap.node.relay import NodeRelay
from memsnap.records import RankPlan, RankRestore, RankSource, Region, RoundResult
from memsnap.waiting import Signal

SOURCE = RankSource(9, 2, 1, "owner-node", 1 << 20, Region(1, 4096, 0), ("h0", "h1", "h2"), (None,) * 3)


class Node:
    def __init__(self) -> None:
        self.node, self.world, self.address = "n" * 56, 2, {"port": 1}
        self.ranks = {0, 1}
        self.holders: dict = {}
        self.newest: int | None = None
        self.resumed: list[tuple[int | None, int]] = []
        self.counters: dict[str, int] = {}
        self.done: list[str] = []  # what the node was told, in order

    def joined(self, rank, world, claim=None, gen=0):
        self.ranks.add(rank)

    def placed(self, answer):
        pass

    def resolved(self, step):
        return self.newest is not None and self.newest >= step

    def resume(self, step, gen):
        self.resumed.append((step, gen))
        self.done.append("resume")

    def roll_back(self, step):
        self.done.append(f"roll back to {step}")
        return []

    def count(self, counter, n):
        self.counters[counter] = self.counters.get(counter, 0) + n

    def rebuild_local(self, step, rank, src, replace=False):
        self.done.append(f"rebuild step {step} rank {rank} from {src.owner} replace={replace}")
        return True


class Coordinator:
    """Answers the relay's calls; ``failed``: the ranks whose loads the round reports failed."""

    def __init__(self, node: Node, failed=()):
        self.node, self.failed = node, set(failed)
        self.calls: list[tuple] = []

    async def __call__(self, method, *args, timeout):
        self.calls.append((method, *args))
        if method == "restore_arrive":
            return None
        if method == "restore_plans":
            return {r: RankPlan(9, "local", "ram", source=SOURCE).to_wire() for r in (0, 1)}
        if method == "restore_report":
            return None
        if method == "restore_result":
            # the node resumes before any rank hears: nothing yet when the result is asked
            assert self.node.resumed == []
            reports = {r: RankRestore.from_wire(w) for _, _, rep in self._reports() for r, w in rep.items()}
            failed = {r: rep for r, rep in reports.items() if r in self.failed or not rep.ok}
            return RoundResult(not failed, failed, 4).to_wire()
        raise AssertionError(method)

    def _reports(self):
        return [c[1:] for c in self.calls if c[0] == "restore_report"]


async def _round(relay: NodeRelay, reports: dict[int, RankRestore]) -> list[RoundResult]:
    async def rank(r: int) -> RoundResult:
        plan = RankPlan.from_wire(await relay.restore_plan(r, 0))
        assert plan.step == 9
        # the node gave up its steps above the plan's before any of its ranks heard it
        assert relay.core.done[0] == "roll back to 9"  # type: ignore[attr-defined]
        return RoundResult.from_wire(await relay.restore_done(r, 0, reports[r].to_wire()))

    return await asyncio.gather(*(rank(r) for r in sorted(reports)))


def test_a_round_every_rank_loaded_resumes_the_node_once_then_answers_every_rank():
    node = Node()
    coord = Coordinator(node)
    relay = NodeRelay(node, coord, Signal())
    loaded = {r: RankRestore.loaded("local", {"total": 0.1}) for r in (0, 1)}
    results = asyncio.run(_round(relay, loaded))
    assert [r.ok for r in results] == [True, True] and {r.gen for r in results} == {4}
    assert node.resumed == [(9, 4)]
    # both ranks' arrivals, plans and reports went out in one call each for the node
    assert [c[0] for c in coord.calls].count("restore_report") == 1
    assert [c[0] for c in coord.calls].count("restore_plans") == 1
    (_, _, reports) = coord._reports()[0]
    assert sorted(reports) == [0, 1] and all(RankRestore.from_wire(w).ok for w in reports.values())


def test_a_round_a_rank_failed_resumes_nothing_and_names_the_rank_and_its_error():
    node = Node()
    relay = NodeRelay(node, Coordinator(node), Signal())
    reports = {0: RankRestore.loaded("local", {}), 1: RankRestore.failed(OSError("chunk 3: bad checksum"))}
    results = asyncio.run(_round(relay, reports))
    assert [r.ok for r in results] == [False, False] and node.resumed == []
    assert results[0].failed[1].error == "OSError: chunk 3: bad checksum" and list(results[0].failed) == [1]


def test_a_report_before_its_plan_is_refused():
    node = Node()
    relay = NodeRelay(node, Coordinator(node), Signal())
    with pytest.raises(CommitError, match="before its restore_plan"):
        asyncio.run(relay.restore_done(0, 0, RankRestore.loaded("local", {}).to_wire()))


def test_the_agent_counts_what_its_ranks_repaired_and_rebuilds_a_corrupt_copy_after_resuming():
    node = Node()
    relay = NodeRelay(node, Coordinator(node), Signal())
    reports = {
        0: RankRestore.loaded("local", {}),
        1: RankRestore.loaded("peer", {}, repaired=3, rebuild=True),  # its node's copy was corrupt
    }
    results = asyncio.run(_round(relay, reports))  # (returns once the agent's threads are done)
    assert all(r.ok for r in results) and node.counters == {"repaired_chunks": 3}
    assert node.done == ["roll back to 9", "resume", "rebuild step 9 rank 1 from owner-node replace=True"]


def test_a_failed_round_rebuilds_nothing_but_still_counts_the_repairs():
    node = Node()
    relay = NodeRelay(node, Coordinator(node, failed={0}), Signal())
    reports = {0: RankRestore.failed(OSError("x"), repaired=2), 1: RankRestore.loaded("peer", {}, 1, rebuild=True)}
    results = asyncio.run(_round(relay, reports))
    assert not any(r.ok for r in results) and node.counters == {"repaired_chunks": 3}
    assert node.done == ["roll back to 9"]  # (once per node and round)
