"""Membership is by node (no Ray): how many nodes a job runs on decides whether pieces go to
peers, spare agents count as holders, and re-protection never puts a shard on its owner."""
from __future__ import annotations

import pytest

from memsnap.config import SnapshotConfig
from memsnap.coordinator import CoordinatorCore
from memsnap.records import CommitRecord, NodeReady, Region
from memsnap.reprotect import new_holders
from memsnap.errors import CommitError


def coordinator(ranks_per_node: dict[str, int], spares=(), **cfg) -> CoordinatorCore:
    """A coordinator whose ranks registered from ``ranks_per_node`` (ranks dealt in order)."""
    world = sum(ranks_per_node.values())
    core = CoordinatorCore(SnapshotConfig("unit-membership", **cfg).to_dict(), world)
    nodes = set(ranks_per_node) | set(spares)
    core.membership.alive = lambda: set(nodes)
    core.membership.find_spares = lambda busy: {n: {"port": 1} for n in spares if n not in busy}
    core.broadcast = lambda *args: None
    rank = 0
    for node, n in ranks_per_node.items():  # one join per node, as the node's agent sends it
        core.join(node, {"port": 1}, list(range(rank, rank + n)))
        rank += n
    return core


def answer(core, node):
    return core.answer(node)


def test_one_node_with_many_ranks_runs_on_local_ram_at_once_and_says_why():
    core = coordinator({"gpu-box": 8})  # defaults: k=2, m=1 -> protection needs 4 nodes
    got = answer(core, "gpu-box")
    assert got["peers"] is False and got["ranks"] == list(range(8))
    assert "1 node(s)" in got["why"] and "k+m+1=4" in got["why"]
    assert core.membership.placement.holders == {"gpu-box": ()} and got["layout"]["holders"] == []


def test_uneven_ranks_per_node_are_placed_by_node():
    core = coordinator({"a": 3, "b": 2, "c": 2, "d": 1})
    assert answer(core, "a")["peers"] is True and answer(core, "a")["ranks"] == [0, 1, 2]
    assert answer(core, "d")["ranks"] == [7]
    for owner, holders in core.membership.placement.holders.items():
        assert len(holders) == 3 and owner not in holders


def test_a_spare_agent_makes_three_rank_nodes_enough_and_holds_pieces():
    assert answer(coordinator({"a": 2, "b": 2, "c": 2}), "a")["peers"] is False
    core = coordinator({"a": 2, "b": 2, "c": 2}, spares=["spare"])
    assert answer(core, "a")["peers"] is True and "spare" in core.membership.addrs
    holders = core.membership.placement.holders
    assert sum(h.count("spare") for o, h in holders.items() if o != "spare") == 3


def test_peers_true_on_too_few_nodes_is_refused_at_once_with_the_fix():
    core = coordinator({"a": 1, "b": 1}, peers=True)
    assert core.membership.decided()  # the Ray face stops waiting: the answer is the refusal
    with pytest.raises(CommitError, match=r"peers=True; ranks run on 2 node\(s\).*start_spare.*peers unset"):
        answer(core, "a")


def test_reprotection_never_places_a_shard_on_its_owner_or_beside_another_shard():
    rec = CommitRecord(5, 2, 1, {"n0": NodeReady(5, "n0", 0, 64, (Region(0, 64, 0), Region(1, 64, 1)),
                                                 ("n1", "n2", "n3"))})
    holders = ["n1", "n2", "n3"]
    moved = {0: "n4", 1: "n4"}  # Ray Train restarted n0's ranks on n4; n0 itself is alive
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3", "n4", "n5"}, moved) == [(0, "n5")]
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3", "n4"}, moved) == [(0, "n4")]  # last resort
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3"}, moved) == []  # never the owner
    two_lost = new_holders(rec, "n0", holders, {"n0", "n3", "n5", "n6"}, moved)
    assert two_lost == [(0, "n5"), (1, "n6")]
