"""Membership is by node (no Ray): how many nodes a job runs on decides whether pieces go to
peers, spare agents count as holders, and re-protection never puts a shard on its owner."""

from __future__ import annotations

import pytest

from memsnap.config import SnapshotConfig
from memsnap.errors import CommitError
from memsnap.job.coordinator import CoordinatorCore
from memsnap.job.reprotect import new_holders
from memsnap.records import CommitRecord, NodeReady, Region


def coordinator(ranks_per_node: dict[str, int], spares=(), **cfg) -> CoordinatorCore:
    """A coordinator whose ranks registered from ``ranks_per_node`` (ranks dealt in order)."""
    world = sum(ranks_per_node.values())
    core = CoordinatorCore(SnapshotConfig("unit-membership", **cfg).to_dict(), world)
    nodes = set(ranks_per_node) | set(spares)
    core.membership.alive = lambda: set(nodes)
    core.membership.find_spares = lambda busy: {n: {"port": 1} for n in spares if n not in busy}
    core.broadcast = lambda *args: None  # type: ignore[method-assign]  # a stand-in for the real method
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
    assert got.peers is False and got.ranks == tuple(range(8))
    assert got.why is not None and "1 node(s)" in got.why and "k+m+1=4" in got.why
    assert core.membership.placement.holders == {"gpu-box": ()} and got.holders is not None
    assert got.holders.holders == ()


def test_uneven_ranks_per_node_are_placed_by_node():
    core = coordinator({"a": 3, "b": 2, "c": 2, "d": 1})
    assert answer(core, "a").peers is True and answer(core, "a").ranks == (0, 1, 2)
    assert answer(core, "d").ranks == (7,)
    for owner, holders in core.membership.placement.holders.items():
        assert len(holders) == 3 and owner not in holders


def test_a_spare_agent_makes_three_rank_nodes_enough_and_holds_pieces():
    assert answer(coordinator({"a": 2, "b": 2, "c": 2}), "a").peers is False
    core = coordinator({"a": 2, "b": 2, "c": 2}, spares=["spare"])
    assert answer(core, "a").peers is True and "spare" in core.membership.addrs
    holders = core.membership.placement.holders
    assert sum(h.count("spare") for o, h in holders.items() if o != "spare") == 3


def test_peers_true_on_too_few_nodes_is_refused_at_once_with_the_fix():
    core = coordinator({"a": 1, "b": 1}, peers=True)
    assert core.membership.decided()  # the Ray face stops waiting: the answer is the refusal
    with pytest.raises(CommitError, match=r"peers=True; ranks run on 2 node\(s\).*start_spare.*peers unset"):
        answer(core, "a")


def test_reprotection_never_places_a_shard_on_its_owner_or_beside_another_shard():
    rec = CommitRecord(
        5, 2, 1, {"n0": NodeReady(5, "n0", 0, 64, (Region(0, 64, 0), Region(1, 64, 1)), ("n1", "n2", "n3"))}
    )
    holders = ["n1", "n2", "n3"]
    moved = {0: "n4", 1: "n4"}  # Ray Train restarted n0's ranks on n4; n0 itself is alive
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3", "n4", "n5"}, moved) == [(0, "n5")]
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3", "n4"}, moved) == [(0, "n4")]  # last resort
    assert new_holders(rec, "n0", holders, {"n0", "n2", "n3"}, moved) == []  # never the owner
    two_lost = new_holders(rec, "n0", holders, {"n0", "n3", "n5", "n6"}, moved)
    assert two_lost == [(0, "n5"), (1, "n6")]


# --- runs: one job name, one run at a time (identity.py) -------------------------------------------
def claim(run, process):
    return {"run": run, "process": process}


def job_of_runs(world: int, live: set[str]) -> CoordinatorCore:
    """A coordinator of ``world`` ranks whose rank processes in ``live`` still run (the agents'
    answer to ``running``, without Ray)."""
    core = CoordinatorCore(SnapshotConfig("unit-runs").to_dict(), world)
    core._alive = core.membership.alive = lambda: {"a", "b", "c"}  # type: ignore[method-assign]  # a stand-in for the real method
    core.find_spares = core.membership.find_spares = lambda busy: {}  # type: ignore[method-assign]  # a stand-in for the real method
    core.broadcast = lambda *args: None  # type: ignore[method-assign]  # a stand-in for the real method
    core.running_holders = lambda holders: {r for r, h in holders.items() if h.process in live}  # type: ignore[method-assign]  # a stand-in for the real method
    return core


def test_a_rank_of_a_second_live_run_is_refused_naming_both_runs_and_the_fix():
    """Two Tune trials with one hard-coded job name: the second's rank 0 finds the first's alive."""
    core = job_of_runs(2, live={"pa0", "pa1"})
    core.join("a", {"port": 1}, [0], 2, {0: claim("trial-a", "pa0")})
    core.join("b", {"port": 1}, [1], 2, {1: claim("trial-a", "pa1")})
    got = core.join("c", {"port": 2}, [0], 2, {0: claim("trial-b", "pb0")})
    why = got.refused[0]
    assert list(got.refused) == [0] and got.hints == {}
    assert "rank 0 of run 'trial-b'" in why and "held by run 'trial-a', still running (process pa0" in why
    assert "its own job name" in why and "run='trial-a'" in why and "memsnap.shutdown('unit-runs')" in why
    assert core.membership.members == {0: "a", 1: "b"} and core.run == "trial-a"  # the first run untouched
    assert core.membership.holders[0].process == "pa0"


def test_a_restart_of_the_same_run_takes_its_ranks_back_on_any_node_even_before_the_old_exits():
    core = job_of_runs(2, live={"pa0", "pa1"})
    core.join("a", {"port": 1}, [0, 1], 2, {0: claim("trial-a", "pa0"), 1: claim("trial-a", "pa0")})
    got = core.join("c", {"port": 2}, [0, 1], 2, {0: claim("trial-a", "new0"), 1: claim("trial-a", "new1")})
    assert got.refused == {} and got.run == "trial-a"
    assert core.membership.members == {0: "c", 1: "c"} and core.membership.holders[1].process == "new1"


def test_a_run_whose_holders_are_gone_takes_over_and_becomes_the_jobs_run():
    live = {"pa0"}
    core = job_of_runs(1, live)
    core.join("a", {"port": 1}, [0], 1, {0: claim("trial-a", "pa0")})
    assert core.join("b", {"port": 1}, [0], 1, {0: claim("trial-b", "pb0")}).refused
    live.clear()  # trial A's process is gone: its job name is free to resume from
    got = core.join("b", {"port": 1}, [0], 1, {0: claim("trial-b", "pb0")})
    assert got.refused == {} and got.run == core.run == "trial-b"


def test_without_run_ids_the_first_registration_makes_one_that_every_rank_and_restart_carries():
    live = {"p0", "p1"}
    core = job_of_runs(2, live)
    run = core.join("a", {"port": 1}, [0], 2, {0: claim(None, "p0")}).run
    assert run.startswith("run-") and core.join("b", {"port": 1}, [1], 2, {1: claim(None, "p1")}).run == run
    second = core.join("c", {"port": 1}, [0], 2, {0: claim(None, "q0")}).refused
    assert "rank 0 of a process with no run id" in second[0] and f"held by run {run!r}" in second[0]
    assert core.join("a", {"port": 1}, [0], 2, {0: claim(None, "p0")}).refused == {}  # the same process again
    live.clear()  # the run's processes died: new ones are its restart
    got = core.join("c", {"port": 1}, [0, 1], 2, {0: claim(None, "q0"), 1: claim(None, "q1")})
    assert got.refused == {} and got.run == run and core.membership.holders[1].run == run


def test_an_elastic_restart_needs_every_holder_of_another_run_gone():
    core = job_of_runs(4, live={"p3"})
    for rank in range(4):
        core.join("abc"[rank % 3], {"port": 1}, [rank], 4, {rank: claim("r", f"p{rank}")})
    got = core.join("a", {"port": 1}, [0, 1], 2, {0: claim("other", "x0"), 1: claim("other", "x1")})
    assert sorted(got.refused) == [0, 1] and "rank 3 is held by run 'r'" in got.refused[1]
    assert core.world == 4 and len(core.membership.members) == 4  # not resized
    got = core.join("a", {"port": 1}, [0, 1], 2, {0: claim("r", "y0"), 1: claim("r", "y1")})
    assert got.refused == {} and core.world == 2 and core.membership.members == {0: "a", 1: "a"}


def test_a_spare_started_after_the_placement_joins_it_and_can_take_a_rank_over():
    """A warm standby's node gets its agent once the job runs (the first standby was used up, a
    rank's process died on a healthy node): its spare agent joins the placement then, and a
    rank it takes over later joins a placed node. Before, that join needed a dead placed node
    and was refused."""
    nodes = {"a", "b", "c", "d", "late"}
    core = coordinator({"a": 1, "b": 1, "c": 1}, spares=["d"], k=1, m=1)
    core.membership.alive = lambda: set(nodes)
    assert "late" not in core.membership.placement.holders
    with pytest.raises(CommitError, match="no placed node was lost"):
        coordinator({"a": 1, "b": 1, "c": 1}, spares=["d"], k=1, m=1).join("late", {"port": 1}, [1])
    epoch = core.membership.epoch
    assert core.spare_joined("late", {"port": 2}) is True
    assert "late" in core.membership.placement.holders and core.membership.epoch == epoch + 1
    assert core.spare_joined("late", {"port": 2}) is False  # placed already: nothing changes
    core.join("late", {"port": 2}, [1])  # rank 1's process died on b; the standby on "late" takes it
    late = core.answer("late")
    assert late.ranks == (1,) and late.holders is not None and late.holders.holders
    core.node_lost("d", "its heartbeats stopped")
    assert core.spare_joined("d", {"port": 1}) is False  # a fenced node never comes back as a spare
