"""The runtime's pure parts without Ray: config, the tier decision, protection, agent slots."""

from __future__ import annotations

import logging
import os

import pytest

from memsnap.config import SnapshotConfig, tunable
from memsnap.errors import CommitError, ConfigError, MemoryBudgetError
from memsnap.job.coordinator import spill_metadata
from memsnap.job.coverage import JobPlan, decide, owner_margin
from memsnap.node.agent import AgentCore
from memsnap.records import CommitNotice, CommitRecord, Inventory, NodeReady, Region

SECRET = b"s" * 32


def test_config_validates_with_messages_that_say_what_to_change():
    with pytest.raises(ConfigError, match="group_size=3: needs at least k\\+m\\+1=4"):
        SnapshotConfig("j", k=2, m=1, group_size=3)
    with pytest.raises(ConfigError, match="job="):
        SnapshotConfig("bad job!")
    with pytest.raises(ConfigError, match="spill=None"):
        SnapshotConfig("j", spill_every=5)
    with pytest.raises(ConfigError, match="multiple of 64"):
        SnapshotConfig("j", chunk=100)
    assert SnapshotConfig("j", spill="/tmp/x").spill_every == 1
    assert SnapshotConfig.from_dict(SnapshotConfig("j", k=3).to_dict()).k == 3


def test_tunables_come_from_one_table_with_env_override(monkeypatch):
    assert tunable("call_timeout_s") == 30.0
    monkeypatch.setenv("MEMSNAP_CALL_TIMEOUT_S", "7")
    assert tunable("call_timeout_s") == 7.0
    with pytest.raises(ConfigError, match="unknown"):
        tunable("nope")


def record(step=5, k=2, m=1, nbytes=1000):
    """Rank r on node nr (1000 bytes: 3 stripes of 2 x 192), held by the next k+m nodes."""
    nodes = {
        f"n{r}": NodeReady(
            step, f"n{r}", 0, 192, (Region(r, nbytes, 0),), tuple(f"n{(r + 1 + j) % 4}" for j in range(k + m))
        )
        for r in range(4)
    }
    return CommitRecord(step, k, m, nodes)


def inventories(step, alive, local=True):
    """What the agents of ``alive`` report: node ni holds its rank i and its share of its peers' shards."""
    out = {}
    for n in alive:
        i = int(n[1:])
        held = {f"n{o}": {j: 3 for j in range(3) if (o + 1 + j) % 4 == i} for o in range(4)}
        out[n] = Inventory(n, versions={step: ("committed", (i,))} if local else {}, held={step: held})
    return out


def test_decide_prefers_local_then_peer_then_durable():
    members = {r: f"n{r}" for r in range(4)}
    recs = {5: record(5)}
    plan = decide(recs, members, inventories(5, ["n0", "n1", "n2", "n3"]), durable_step=4)
    assert plan == JobPlan(5, "ram", {0: "local", 1: "local", 2: "local", 3: "local"})
    moved = {**members, 2: "n9"}  # rank 2 on a replacement node
    inv = inventories(5, ["n0", "n1", "n3"])
    inv["n9"] = Inventory("n9")
    assert decide(recs, moved, inv, None).ranks[2] == "peer"
    # three nodes lost: rank 0's holders n1, n2, n3 -> only n3 left < k
    inv = {"n3": inventories(5, ["n3"])["n3"], "n7": Inventory("n7"), "n8": Inventory("n8"), "n9": Inventory("n9")}
    gone = {0: "n7", 1: "n8", 2: "n9", 3: "n3"}
    assert decide(recs, gone, inv, durable_step=4) == JobPlan(4, "durable", {r: "durable" for r in range(4)})
    assert decide(recs, gone, inv, durable_step=None).plan == "none"
    assert decide(recs, members, inventories(5, ["n0", "n1", "n2", "n3"]), None, bad={5}).plan == "none"


def test_a_rank_that_moved_reads_its_old_nodes_copy_before_the_holders():
    recs = {5: record(5)}
    inv = inventories(5, ["n0", "n1", "n2", "n3"])
    inv["n9"] = Inventory("n9")
    moved = {0: "n1", 1: "n0", 2: "n9", 3: "n3"}  # 0 and 1 swapped nodes; 2 on a new node
    tiers = decide(recs, moved, inv, None).ranks
    assert tiers == {0: "copy", 1: "copy", 2: "copy", 3: "local"}
    del inv["n2"]  # rank 2's old node is gone: its holders serve it
    assert decide(recs, moved, inv, None).ranks[2] == "peer"
    assert decide(recs, moved, inv, None, local_copy=False).ranks[0] == "peer"  # lean: no copy to read


def test_owner_margin_counts_holders_and_the_local_copy():
    rec, members = record(5), {r: f"n{r}" for r in range(4)}
    assert owner_margin(rec, "n0", members, inventories(5, ["n0", "n1", "n2", "n3"])) == 2
    assert owner_margin(rec, "n0", members, inventories(5, ["n1", "n2", "n3"])) == 1  # no local copy
    assert owner_margin(rec, "n0", members, inventories(5, ["n0", "n3"])) == 0  # only the local copy
    assert owner_margin(rec, "n0", members, inventories(5, ["n3"])) == -1


class _Inline:
    """An executor that runs what is submitted at once (the agent's background calls, in order)."""

    def submit(self, fn, *args):
        fn(*args)

    def shutdown(self, wait=True):
        pass


@pytest.fixture
def core():
    cfg = SnapshotConfig("unit-agent", k=2, m=1, keep=2, memory_budget=1 << 20).to_dict()
    c = AgentCore(cfg, "f" * 56, SECRET)
    yield c
    c.shutdown()


def test_agent_slots_keep_committed_versions_whole(core):
    slots = [core.begin(s, 0, 4096)["slot"] for s in (1,)]
    core.versions[1].state = "committed"
    slots.append(core.begin(2, 0, 4096)["slot"])
    core.versions[2].state = "committed"
    slots.append(core.begin(3, 0, 4096)["slot"])
    assert slots == [0, 1, 2]  # keep=2 committed + 1 being captured
    core.versions[3].state = "committed"
    assert core.begin(4, 0, 4096)["slot"] == 0  # the oldest beyond keep is reused
    assert sorted(core.versions) == [2, 3, 4]
    with pytest.raises(CommitError, match="captured\\(step=9"):
        core.captured(9, 0, "{}", [0])


def test_agent_refuses_a_snapshot_over_budget_naming_the_setting(core):
    with pytest.raises(MemoryBudgetError, match=r"needs 2097152 bytes.*memory_budget"):
        core.begin(1, 0, 2 << 20)


def test_spilled_steps_record_their_config_and_versions():
    import json

    meta = spill_metadata(SnapshotConfig("j", spill="/tmp/x", spill_every=5), 10, "trial-a")
    assert meta["step"] == 10 and meta["config"]["spill_every"] == 5 and meta["versions"]["ray"]
    assert meta["run"] == "trial-a"
    json.dumps(meta)


# --- lean mode (local_copy=False) ------------------------------------------------------------------
def test_lean_config_is_validated_and_round_trips():
    lean = SnapshotConfig("j", local_copy=False)
    assert SnapshotConfig.from_dict(lean.to_dict()) == lean and lean.to_dict()["local_copy"] is False
    assert (lean.slots, SnapshotConfig("j", keep=3).slots) == (1, 4)  # one reused staging arena
    with pytest.raises(ConfigError, match="local_copy='no': must be True"):
        SnapshotConfig("j", local_copy="no")
    assert SnapshotConfig("j", spill="/tmp/x", local_copy=False).slots == 2  # + a step held for its spill
    with pytest.raises(ConfigError, match="peers=False with local_copy=False"):
        SnapshotConfig("j", peers=False, local_copy=False)


def test_lean_decide_reads_every_rank_from_peers():
    members = {r: f"n{r}" for r in range(4)}
    recs, everyone = {5: record(5)}, ["n0", "n1", "n2", "n3"]
    peer = JobPlan(5, "ram", {r: "peer" for r in range(4)})
    assert decide(recs, members, inventories(5, everyone), None, local_copy=False) == peer
    assert decide(recs, members, inventories(5, everyone, local=False), None) == peer
    # n0 and n1 lost (m+1 = 2 nodes): ranks 2 and 3 keep one holder of k=2 each; only the
    # local copies on n2 and n3 still have them, so lean mode falls back to durable
    inv = inventories(5, ["n2", "n3"])
    inv |= {"n7": Inventory("n7"), "n8": Inventory("n8")}
    moved = {0: "n7", 1: "n8", 2: "n2", 3: "n3"}
    assert decide(recs, moved, inv, durable_step=4).ranks == {0: "peer", 1: "peer", 2: "local", 3: "local"}
    assert decide(recs, moved, inv, durable_step=4, local_copy=False).plan == "durable"


def test_lean_protection_counts_m_losses_not_m_plus_one():
    from memsnap.job.placement import NodeInfo, place, protection_level

    rec, members = record(5), {r: f"n{r}" for r in range(4)}
    alive = ["n0", "n1", "n2", "n3"]
    margins = [
        owner_margin(rec, "n0", members, inventories(5, nodes), local_copy=False)
        for nodes in (alive, ["n0", "n2", "n3"], ["n0", "n3"])
    ]
    assert margins == [1, 0, -1]  # the owner alive with its arena does not count in lean mode
    p = place([NodeInfo(n) for n in alive], 2, 1)
    assert protection_level(p, set(alive), local_copy=False) == {0: 1}
    assert protection_level(p, set(alive)) == {0: 2}


@pytest.fixture
def lean():
    cfg = SnapshotConfig("unit-lean", k=2, m=1, keep=2, memory_budget=1 << 20, local_copy=False).to_dict()
    c = AgentCore(cfg, "e" * 56, SECRET)
    yield c
    c.shutdown()


def test_lean_agent_frees_its_slot_on_commit_and_keeps_no_local_copy(lean, core):
    for agent in (lean, core):
        agent.begin(1, 0, 4096)
        agent.arenas[(0, 0)].view(0, 4)[:] = b"step"
        agent.versions[1].state, agent.versions[1].manifests[0] = "ready", "{}"
        agent.commit(CommitNotice(1, (1,)))
    assert core.local(1, 0) is not None and core.inventory().bytes["local"] == 4096
    assert bytes(core.arenas[(0, 0)].view(0, 4)) == b"step"
    inv = lean.inventory()
    assert lean.local(1, 0) is None and inv.versions == {} and inv.bytes["local"] == 0
    # the staging arena keeps its file and mapping but gives its pages back until the next capture
    assert inv.bytes["arena"] == 0 and inv.committed == (1,)
    assert bytes(lean.arenas[(0, 0)].view(0, 4)) == bytes(4)
    assert lean.begin(2, 0, 4096)["slot"] == 0 and lean.begin(2, 1, 4096)["slot"] == 0
    assert lean.inventory().bytes["arena"] == 2 * 4096
    lean.versions[2].state = "sending"  # still being sent: the one slot is busy, step 3 is skipped
    told = []
    lean.tell, lean.pool = lambda *args: told.append(args), _Inline()
    assert "every arena slot is busy" in lean.begin(3, 0, 4096)["skipped"]
    assert "skipped" in lean.begin(3, 1, 4096)  # every rank of the node skips the same step
    assert lean.counters["skipped_busy"] == 1 and lean.counters["failed_snapshots"] == 0
    assert [t[:2] for t in told] == [("node_skipped", 3)]
    lean.versions[2].state = "ready"  # every chunk acknowledged: the arena is not needed any more
    assert lean.begin(4, 0, 4096)["slot"] == 0 and lean.versions[2].state == "ready"
    assert core.begin(2, 0, 4096)["slot"] == 1
    core.versions[2].state = "ready"
    assert core.begin(3, 0, 4096)["slot"] == 2  # with the local copy, a ready version keeps its slot


def test_lean_restore_takes_the_slot_back_from_steps_not_committed_here(lean):
    lean.begin(6, 0, 4096)
    lean.versions[6].state = "ready"  # acknowledged, but its commit has not reached this agent
    lean.begin(7, 0, 4096)
    lean.versions[7].state = "queued"  # the rank died after capturing step 7
    lean.slots.clear_for_restore(6)
    assert lean.versions == {} and lean.slots.free_slot(6) == 0


def test_a_burst_of_saves_coalesces_newest_wins_and_nothing_counts_as_failed(core):
    """Saves faster than the pipeline: a capture that finds every slot taken replaces the
    older one still queued for the sender, or is skipped; never fails."""
    told = []
    core.tell = lambda *args: told.append(args)
    core.sender.send = lambda v, ranks: None  # the sender is busy: captured versions stay queued
    core.pool = _Inline()
    for step in (1, 2):
        core.begin(step, 0, 4096)
        core.captured(step, 0, "{}", [0])
    core.versions[1].state = "committed"
    core.versions[2].state = "sending"
    for step in (3, 4, 5):  # each replaces the previous one, still queued
        assert "slot" in core.begin(step, 0, 4096)
        core.captured(step, 0, "{}", [0])
    assert {s: v.state for s, v in core.versions.items()} == {1: "committed", 2: "sending", 5: "queued"}
    assert [t[:2] for t in told] == [("node_skipped", 3), ("node_skipped", 4)]
    assert core.counters["superseded"] == 2 and core.counters["failed_snapshots"] == 0
    assert "skipped" in core.begin(4, 0, 4096)  # a late rank of a replaced step skips it too
    # sent, its commit on the way: it keeps its slot (were it replaced on this node alone, it
    # would fail on every node, and under steady pressure no step would ever commit)
    core.versions[2].state = "ready"
    core.versions[5].state = "sending"
    assert "skipped" in core.begin(6, 0, 4096) and core.versions[2].state == "ready"


def _gather_writing(fill: bytes, during=None):
    """A stand-in for ``restore.gather``: runs ``during`` (the rank saving on meanwhile), fills ``out``."""

    def gather(core, src, out):
        if during is not None:
            during()
        out[:] = fill * (len(out) // len(fill))
        return {"repaired": 0}

    return gather


def test_a_rebuilt_local_copy_is_installed_only_if_the_rank_has_not_moved_on(core, monkeypatch):
    """Re-protection reads a restored rank's bytes back as the node's local copy while the rank
    trains on: it gathers into an arena of its own and never takes over a slot a newer save uses."""
    import memsnap.coding.restore

    rec = record(7, nbytes=4096).source(0, {})
    core.repair.hold_manifests(7, "n0", record(7, nbytes=4096).nodes["n0"].to_wire(), {0: "{}"})  # held here for n0
    used = core.budget.used
    monkeypatch.setattr(memsnap.coding.restore, "gather", _gather_writing(b"x", during=lambda: core.begin(8, 0, 4096)))
    assert core.rebuild_local(7, 0, rec) is False  # step 8 began during the gather
    assert 7 not in core.versions and core.versions[8].state == "capturing"
    assert core.budget.used == used + 4096  # only step 8's arena is charged
    monkeypatch.setattr(memsnap.coding.restore, "gather", _gather_writing(b"y"))
    assert core.rebuild_local(7, 0, rec) is False  # the rank moved on: nothing to do
    core.versions.abandoned(8, "the rank gave step 8 up", failed=False)
    assert core.rebuild_local(7, 0, rec) is True
    info = core.local(7, 0)
    assert info is not None and info["nbytes"] == 4096
    with open(info["path"], "rb") as f:
        assert f.read(4096) == b"y" * 4096
    assert core.rebuild_local(7, 0, rec) is False  # already held
    monkeypatch.setattr(memsnap.coding.restore, "gather", _gather_writing(b"z"))
    assert core.rebuild_local(7, 0, rec, replace=True) is True  # over a copy found corrupt
    new = core.local(7, 0)["path"]
    assert new != info["path"] and not os.path.exists(info["path"])
    with open(new, "rb") as f:
        assert f.read(4096) == b"z" * 4096


def test_options_come_in_groups_or_as_their_shorthand_and_bad_ones_say_what_to_fix():
    from memsnap.options import Failures, Protection, Spill, resolve

    grouped = resolve({"protection": Protection(k=4, m=2), "spill": Spill("s3://b/run", every=100)}, {})
    flat = resolve({"spill": "s3://b/run"}, {"k": 4, "m": 2, "spill_every": 100})
    assert grouped == flat and grouped["protection"].k == 4 and grouped["spill"].uri == "s3://b/run"
    assert resolve({}, {})["when"].every_steps == 1  # the defaults
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['kk'\].*shorthand keywords"):
        resolve({}, {"kk": 2})
    with pytest.raises(ConfigError, match=r"k=3 and protection=.*both given"):
        resolve({"protection": Protection(k=4)}, {"k": 3})
    with pytest.raises(ConfigError, match="on_error='loud'"):
        Failures(on_error="loud")
    with pytest.raises(ConfigError, match=r"memory=4: pass a memsnap.options.Memory"):
        resolve({"memory": 4}, {})


def test_a_job_name_reused_with_another_configuration_is_refused_naming_the_fields():
    from memsnap.rank import check_same_job

    running = SnapshotConfig("reused", k=2, m=1).to_dict()
    check_same_job(SnapshotConfig("reused", k=2, m=1), running)  # the same: fine
    with pytest.raises(ConfigError, match=r"k=4 \(running: 2\), m=2 \(running: 1\).*memsnap.shutdown\('reused'\)"):
        check_same_job(SnapshotConfig("reused", k=4, m=2), running)


def test_a_step_that_failed_elsewhere_is_still_attempted_here_but_a_skipped_one_is_not(core):
    """A rank's own error is its own (each rank counts the failure it saw), while a step the
    job skipped under load is skipped by every rank without capturing."""
    core.pool = _Inline()
    core.abandon(3, "node x: MemoryBudgetError", failed=True)  # another node's rank failed step 3
    assert "slot" in core.begin(3, 0, 4096)  # this rank still tries (and may fail with its own error)
    core.captured(3, 0, "{}", [0])  # the capture is dropped, and its slot given back
    assert 3 not in core.versions
    core.abandon(4, "node x: skipped, every arena slot is busy", failed=False)
    assert "skipped" in core.begin(4, 0, 4096) and 4 not in core.versions
    assert core.counters["failed_snapshots"] == 0


@pytest.mark.parametrize("how", ["refused as given up", "abandoned while sent", "a holder failed"])
def test_a_send_in_vain_for_a_step_the_job_gave_up_is_not_a_failure(core, how):
    """Under load the job gives a step up (a node replaced it) while this node still sends it:
    a holder that heard first refuses the push (``StepGivenUp``), or the send fails after this
    node freed the version. Neither is a failed snapshot, nor news for the coordinator; a
    holder that fails a push of a live step is both."""
    from memsnap.errors import StepGivenUp, TransportError

    told = []
    core.tell, core.pool = lambda *args: told.append(args), _Inline()
    v_step = 3

    def push(v, ranks):
        if how == "refused as given up":
            raise StepGivenUp(f"push to 127.0.0.1:1: the peer refused chunk of step {v.step}: the job gave up")
        if how == "abandoned while sent":
            core.abandon(v.step, "node x: replaced by step 4", failed=False)
        raise TransportError("push to 127.0.0.1:1: connection reset")

    core.sender._encode_and_push = push
    core.begin(v_step, 0, 4096)
    core.captured(v_step, 0, "{}", [0])
    failed = how == "a holder failed"
    assert core.counters["failed_snapshots"] == int(failed)
    assert [t[:2] for t in told if t[0] == "node_failed"] == ([("node_failed", v_step)] if failed else [])
    assert (v_step in core.versions) is failed and (not failed or core.versions[v_step].state == "failed")


def test_a_step_the_job_gave_up_refuses_the_pushes_still_coming_for_it_until_a_resume_below_it(core):
    """A peer still sending an abandoned step would refill the budget with it, and with no
    commit of it to come nothing would free it: the agent's chunk store refuses them."""
    from memsnap.errors import StepGivenUp
    from memsnap.transport.base import ChunkKey

    core.pool = _Inline()
    late = ChunkKey(7, "peer-node", 0, 1)
    core.store.put(late, b"x" * 4096)
    core.abandon(7, "node x: skipped, every arena slot is busy", failed=False)
    assert core.store.keys() == []
    with pytest.raises(StepGivenUp, match="gave up"):
        core.store.reserve(ChunkKey(7, "peer-node", 1, 1), 4096)
    core.resume(5, gen=1)  # the job rolled back to 5: step 7 is taken again
    core.store.put(ChunkKey(7, "peer-node", 1, 1), b"y" * 4096)
    assert core.store.keys() == [ChunkKey(7, "peer-node", 1, 1)]


def test_every_slot_of_a_rank_is_made_and_backed_ahead_of_its_first_saves(core):
    """The first keep+1 saves then find their arenas ready instead of touching fresh pages."""
    assert core.ready_slots(0, 4096) == 3 and core.budget.used == 3 * 4096  # keep=2: three slots
    ahead = {slot: core.arenas[(0, slot)] for slot in range(3)}
    for step in (1, 2, 3):
        info = core.begin(step, 0, 4096)
        assert core.arenas[(0, info["slot"])] is ahead[info["slot"]] and info["path"] == ahead[info["slot"]].path
        core.versions[step].state = "committed"
    assert core.budget.used == 3 * 4096 and core.ready_slots(0, 4096) == 0  # nothing made twice
    assert core.ready_slots(1, 600 << 10) == 1  # a 1 MiB budget: one more slot fits, then it stops


def test_a_standbys_arenas_made_before_it_has_a_rank_become_the_slots_of_the_rank_it_takes(core):
    """A warm standby's node backs keep+1 arenas for whichever rank it takes (at most the
    largest rank's size): the taken rank's first saves and its ``ready_slots`` only rename them."""
    assert core.ready_standby(8192) == 3 and core.budget.used == 3 * 8192
    assert core.ready_standby(8192) == 0  # made once
    made = list(core.slots.standby)
    info = core.begin(1, 2, 4096)  # the standby took rank 2 (smaller than the largest): its first save
    assert core.arenas[(2, info["slot"])] is made[0] and "-sstandby" not in info["path"]
    assert os.path.exists(info["path"]) and core.budget.used == 3 * 8192  # nothing new backed
    assert core.ready_slots(2, 4096) == 2 and core.budget.used == 3 * 8192  # the other two, renamed
    assert {id(core.arenas[(2, s)]) for s in range(3)} == {id(a) for a in made} and core.slots.standby == []
    assert core.ready_standby(8192) == 0  # a node with a rank makes none


def test_a_standby_arena_made_while_a_rank_takes_the_node_is_let_go(core, monkeypatch):
    """The standby took a rank (its first save made an arena) while its node was still making
    the standby's arenas: the one in the making is discarded, not kept charged and unused."""
    from memsnap.node import slots as slots_mod

    real = slots_mod.Arena.create

    def create(path, nbytes, prefault=True):
        arena = real(path, nbytes, prefault)
        if "-sstandby1-" in path:
            core.begin(1, 0, 2 * nbytes)  # (too large for the one already made: a new arena)
        return arena

    monkeypatch.setattr(slots_mod.Arena, "create", staticmethod(create))
    assert core.ready_standby(4096) == 1
    assert len(core.slots.standby) == 1 and core.budget.used == 4096 + 8192
    assert not [n for n in os.listdir(slots_mod.naming.arena_dir()) if "-sstandby1-" in n and core.cfg.job in n]


def test_a_standbys_arenas_too_small_for_the_rank_it_took_are_let_go(core):
    core.ready_standby(4096)
    info = core.begin(1, 0, 8192)  # the state grew since: a new arena, and the small ones go
    assert info["nbytes"] == 8192 and len(core.slots.standby) == 3
    core.ready_slots(0, 8192)
    assert core.slots.standby == [] and core.budget.used == 3 * 8192
    assert not [n for n in os.listdir(os.path.dirname(info["path"])) if "-sstandby" in n and core.cfg.job in n]


def test_a_save_that_arrives_while_its_slot_is_made_ahead_waits_for_it_and_uses_it(core, monkeypatch) -> None:
    """The first save can come before ``ready_slots`` has backed slot 0 (it runs in the
    background after ``restore``): the save waits for that arena and captures into it, rather
    than fail on the half-made file or back a second arena beside it."""
    import threading

    from memsnap.node import slots as slots_mod

    real, inside, go = slots_mod.Arena.create, threading.Event(), threading.Event()

    def slow_create(path, nbytes, prefault=True):
        if "-sahead0-" in path:
            inside.set()
            assert go.wait(10)
        return real(path, nbytes, prefault)

    monkeypatch.setattr(slots_mod.Arena, "create", staticmethod(slow_create))
    ahead = threading.Thread(target=core.ready_slots, args=(0, 4096))
    ahead.start()
    assert inside.wait(10)  # slot 0 is being made ahead
    got: dict = {}
    save = threading.Thread(target=lambda: got.update(core.begin(1, 0, 4096)))
    save.start()
    save.join(0.3)
    assert save.is_alive() and not got  # the save waits for the slot being made...
    go.set()
    save.join(10)
    ahead.join(10)
    assert got["slot"] == 0 and got["path"] == core.arenas[(0, 0)].path  # ...and captures into it
    assert "ahead" not in got["path"] and os.path.exists(got["path"])
    assert core.budget.used == 3 * 4096  # three slots, none made twice


def test_a_budget_below_what_the_state_needs_is_named_once_with_the_size_to_set(core, caplog):
    """1 MiB of budget, keep=2, RS(2,1): 4096 bytes of state need 9 x 4096 (memsnap plan); two
    ranks of 64 KiB need 9 x 128 KiB, more than the budget: one warning naming the size."""
    from memsnap.policy import agent_ram

    with caplog.at_level(logging.WARNING, logger="memsnap.agent"):
        core.begin(1, 0, 4096)
        assert "raise memory_budget" not in caplog.text
        core.begin(2, 0, 64 << 10)
        core.begin(2, 1, 64 << 10)
        need = int(agent_ram(128 << 10, 2, 1, 2))
        assert need > 1 << 20
        warned = [r.getMessage() for r in caplog.records if "raise memory_budget" in r.getMessage()]
        assert len(warned) == 1 and f"raise memory_budget to {need}" in warned[0]
        core.begin(3, 1, 64 << 10)  # the same need: not again
        assert len([r for r in caplog.records if "raise memory_budget" in r.getMessage()]) == 1


def _busy_with_a_spill(core) -> list:
    """keep=2, three slots: step 1 committed and being spilled, 2 committed, 3 being sent:
    nothing can give way to a new capture. Returns the calls the agent makes on the coordinator."""
    told = []
    core.tell, core.pool = lambda *args: told.append(args), _Inline()
    for step, state in ((1, "committed"), (2, "committed"), (3, "sending")):
        core.begin(step, 0, 4096)
        core.versions[step].state = state
    core.slots.pinned = lambda s: s == 1
    return told


def test_a_save_that_may_wait_is_told_busy_and_nothing_is_skipped(core):
    told = _busy_with_a_spill(core)
    busy = core.begin(4, 0, 4096, wait=True)
    assert "every arena slot is busy" in busy["busy"] and "(3, 'sending')" in busy["busy"]
    assert 4 not in core.versions and 4 not in core.skipped and told == []
    assert core.counters["skipped_busy"] == 0
    core.slots.pinned = lambda s: False  # the spill of step 1 is done: it can give way
    assert "slot" in core.begin(4, 0, 4096, wait=True) and sorted(core.versions) == [2, 3, 4]
    core.versions[4].state = "sending"  # busy again: nothing can give way to step 5
    assert "skipped" in core.begin(5, 0, 4096)  # without wait, as before: skipped and counted
    assert core.counters["skipped_busy"] == 1 and [t[:2] for t in told] == [("node_skipped", 5)]


def test_a_waiting_begin_takes_the_slot_that_frees_and_skips_only_at_its_deadline(core):
    import asyncio

    from memsnap.actors import begin_waiting
    from memsnap.waiting import Signal

    _busy_with_a_spill(core)
    signal = Signal()
    core.changed = signal.notify
    answers = []

    async def run(fn, *args):  # the actor's thread pool, inline; frees a slot after the first answer
        answers.append(fn(*args))
        if len(answers) == 1:

            def spilled():
                core.slots.pinned = lambda s: False
                core.changed()

            asyncio.get_running_loop().call_soon(spilled)
        return answers[-1]

    got = asyncio.run(begin_waiting(run, core, signal, 4, 0, 4096, wait_s=600))
    assert "busy" in answers[0] and "slot" in got and len(answers) == 2
    assert core.counters["skipped_busy"] == 0

    core.versions[4].state = "sending"  # busy again, and nothing will free: skipped at the deadline
    core.versions[3].state = "committed"
    core.slots.pinned = lambda s: s == 2

    async def inline(fn, *args):
        return fn(*args)

    got = asyncio.run(begin_waiting(inline, core, signal, 5, 0, 4096, wait_s=0.3))
    assert "skipped" in got and core.counters["skipped_busy"] == 1


def test_wait_on_a_skipped_step_answers_once_the_older_step_in_flight_commits(core):
    """Step 4 is skipped while step 3 is still being sent: ``wait(4)`` must not answer step 2
    (the newest committed when 4 was dropped) while 3 may commit moments later."""
    _busy_with_a_spill(core)
    core.commit(CommitNotice(2, (1, 2)))
    core.abandon(4, "node x: skipped, every arena slot is busy", failed=False)
    assert core.newest == 2 and not core.resolved(4)  # step 3 is on its way
    core.versions[3].state = "ready"
    assert not core.resolved(4)
    core.commit(CommitNotice(3, (2, 3)))
    assert core.resolved(4) and core.newest == 3
    core.abandon(6, "node x: MemoryBudgetError", failed=True)  # nothing older in flight: at once
    assert core.resolved(6)


def test_a_signal_wakes_the_next_waiter_or_lets_it_time_out():
    import asyncio

    from memsnap.waiting import Signal

    async def main():
        signal = Signal()
        assert await signal.next(0.05) is False and await signal.next(0) is False
        asyncio.get_running_loop().call_soon(signal.notify)
        return await signal.next(600)

    assert asyncio.run(main()) is True


def test_a_forced_save_ignores_the_policy_and_lets_the_agent_wait_for_a_slot(monkeypatch):
    """``save(step, state, force=True)``: taken although the policy would skip the step, and
    the agent's ``begin`` may wait ``forced_save_wait_s`` for a busy pipeline."""
    from memsnap.rank.client import AgentClient
    from memsnap.rank.save import Capture
    from memsnap.rank.snapshotter import Snapshotter

    monkeypatch.setenv("MEMSNAP_FORCED_SAVE_WAIT_S", "42")
    snap = object.__new__(Snapshotter)
    snap.rank, snap.node, snap.config = 0, "n" * 56, SnapshotConfig("stub-job")
    snap.counters = {"saves": 0, "failed_saves": 0, "skipped_saves": 0, "skipped_busy": 0}
    snap._watcher, snap._guard, snap._plan = None, None, None
    snap._policy = type("NeverDue", (), {"due": lambda self, s: False, "taken": lambda self, s, t: None})()
    begun = []
    client = AgentClient(None, 0)
    client._call = lambda method, *a, timeout=None: begun.append(a) or {"skipped": "every arena slot is busy"}
    snap.client = client
    snap._local_ranks = lambda: [0]
    plan = type("Plan", (), {"plan": lambda self, state: (type("L", (), {"nbytes": 64})(), [])})()
    snap.capture = Capture(client, None, "stub-job", 1, None, plan=plan)
    assert snap.save(7, {}) is False and begun == [] and snap.counters["skipped_saves"] == 1  # not due
    assert snap.save(7, {}, force=True) is False  # taken to the agent, which skipped it all the same
    assert begun == [(7, 0, 64, 42.0)] and snap.counters["skipped_busy"] == 1


# --- runs (identity.py) ----------------------------------------------------------------------------
def test_a_process_token_runs_until_its_process_is_gone_and_a_zombie_or_reused_pid_does_not():
    import subprocess
    import sys

    from memsnap.identity import process_token, running

    me = process_token()
    assert running([me]) == [me]
    assert running([f"{os.getpid()}-1"]) == []  # the same pid, another start time: a reused pid
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    token = process_token(child.pid)
    assert running([token, me]) == [token, me]
    child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: a zombie
    assert running([token]) == []
    child.wait()
    assert running([token]) == []


def test_a_process_that_has_begun_to_exit_no_longer_runs(monkeypatch):
    """A killed process frees its memory before it closes its sockets; its stat's flags say it
    is exiting (PF_EXITING) from the start: its node answers at once that it has ended."""
    from memsnap import identity

    me = identity.process_token()
    state, start, flags = identity.parse_stat(open("/proc/self/stat").read())
    assert state == "R" and f"{os.getpid()}-{start}" == me and not flags & identity.PF_EXITING
    monkeypatch.setattr(identity, "_stat", lambda pid: (state, start, flags | identity.PF_EXITING))
    assert identity.running([me]) == [] and identity.working([me]) == []
    monkeypatch.setattr(identity, "_stat", lambda pid: (state, start, flags))
    assert identity.running([me]) == [me]
    # a command name with ') ' in it does not shift the fields
    line = "12 (a) b) R 1 12 12 0 -1 4194564 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0"
    assert identity.parse_stat(line) == ("R", 777, 4194564) and identity.parse_stat("12 (x") is None


def test_a_stopped_process_runs_but_is_not_working_until_it_is_continued():
    """What the in-place controller asks a silent member's node: a stopped process (SIGSTOP)
    will not beat again by itself; a running one, however slow, may."""
    import signal
    import subprocess
    import sys

    from memsnap.identity import process_token, running, working
    from memsnap.localcluster import wait_for

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        token = process_token(child.pid)
        assert working([token]) == [token]
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: working([token]) == [], timeout=30, what="the child to be stopped")
        assert running([token]) == [token]
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: working([token]) == [token], timeout=30, what="the child to run again")
    finally:
        child.kill()
        child.wait()
    assert working([token]) == []


def test_a_refused_rank_leaves_the_agent_as_the_live_run_left_it(core):
    import asyncio

    from memsnap.errors import JobInUseError
    from memsnap.node.relay import NodeRelay
    from memsnap.waiting import Signal

    core.joined(0, 2, {"run": "trial-a", "process": "p0"})
    answers = {
        4: {"hints": {}, "run": "trial-a", "refused": {0: "job 'unit-agent': rank 0 of run 'trial-b' ..."}, "gen": 0},
        2: {"hints": {1: 64}, "run": "trial-a", "refused": {}, "gen": 0},
    }

    async def call(method, node, address, ranks, world, claims, timeout):
        assert method == "join" and list(claims) == ranks
        return answers[world]

    relay = NodeRelay(core, call, Signal())
    with pytest.raises(JobInUseError, match="rank 0 of run 'trial-b'"):
        asyncio.run(relay.join(0, 4, {"run": "trial-b", "process": "q0"}))
    assert core.world == 2 and core.ranks == {0} and core.holders == {0: {"run": "trial-a", "process": "p0"}}
    assert asyncio.run(relay.join(1, 2, {"run": None, "process": "p1"})) == (64, "trial-a")
    assert core.holders[1] == {"run": "trial-a", "process": "p1"} and core.committed_infos().run == "trial-a"


def test_ray_train_runs_and_tune_trials_get_a_job_name_and_run_id_of_their_own():
    from types import SimpleNamespace

    from memsnap.identity import run_identity

    def v2_only():
        raise DeprecationWarning("get_trial_name is deprecated")

    trial = SimpleNamespace(
        get_trial_name=lambda: "TorchTrainer_8b1c0_00000",
        get_trial_id=lambda: "8b1c0_00000",
        get_experiment_name=lambda: "sweep",
    )
    assert run_identity(trial) == ("TorchTrainer_8b1c0_00000", "8b1c0_00000")
    v2 = SimpleNamespace(
        get_trial_name=v2_only, get_trial_id=v2_only, get_experiment_name=lambda: "ray_train_run-2025-01-01_10:00:00"
    )
    one = run_identity(v2, lambda: "0123456789abcdef")
    two = run_identity(v2, lambda: "fedcba9876543210")  # a second trainer started in the same second
    assert one == ("ray_train_run-2025-01-01_10-00-00-01234567", "ray_train_run-2025-01-01_10-00-00-0123456789abcdef")
    assert one[0] != two[0] and one[1] != two[1]
    assert SnapshotConfig(one[0]).job == one[0] and len(run_identity(v2, lambda: "f" * 200)[1]) <= 64


def test_job_in_a_spill_uri_is_the_job_name_and_a_bad_run_id_is_refused():
    from memsnap.identity import check_run
    from memsnap.options import resolve
    from memsnap.rank import job_config

    assert job_config("trial-3", resolve({"spill": "s3://bucket/ckpt/{job}"}, {})).spill == "s3://bucket/ckpt/trial-3"
    with pytest.raises(ConfigError, match=r"run='a b': use 1-128 characters"):
        check_run("a b")


def _commit_here(agent, step: int, ranks: list[int], nbytes: int, keep: int = 2) -> None:
    """``ranks`` of this node save ``step`` and the job commits it."""
    for rank in ranks:
        agent.begin(step, rank, nbytes)
    agent.versions[step].state = "ready"
    agent.versions[step].manifests.update({rank: "{}" for rank in ranks})
    agent.commit(CommitNotice(step, tuple(range(max(1, step - keep + 1), step + 1))))


def test_a_rank_that_saved_a_step_elsewhere_gives_its_arenas_back_for_the_next_rank_here(core):
    """A standby on another node took rank 1 (its process died; this node and agent stayed):
    once a step commits that rank 1 did not save here, its arenas and their share of the budget
    go, so the rank a later recovery places here fits, and the node no longer claims rank 1."""
    nbytes = 160 << 10  # keep=2: three slots a rank; two ranks fill 960 KiB of the 1 MiB budget
    for step in (1, 2, 3):
        _commit_here(core, step, [0, 1], nbytes)
    assert len(core.arenas) == 6 and core.budget.used == 6 * nbytes
    assert core.budget.used + 3 * nbytes > core.cfg.memory_budget  # no room for a third rank's slots
    _commit_here(core, 4, [0], nbytes)  # rank 1 saved step 4 on another node
    assert sorted(core.arenas) == [(0, 0), (0, 1), (0, 2)] and core.budget.used == 3 * nbytes
    assert core.local(3, 0) is not None and core.local(3, 1) is None
    assert core.committed_infos().ranks == (0,)
    _commit_here(core, 5, [0, 2], nbytes)  # the rank placed here next has the room
    assert core.local(5, 2) is not None and core.counters["failed_snapshots"] == 0


def test_a_rank_that_only_made_its_arenas_ahead_keeps_them_across_older_commits(core):
    """A rank that registered here and is restoring (slots made ahead, no save yet) is not taken
    for one that left when a commit it could not have taken part in arrives."""
    _commit_here(core, 1, [0], 4096)
    assert core.ready_slots(1, 4096) == 3
    _commit_here(core, 2, [0], 4096)
    assert sorted(r for r, _ in core.arenas) == [0, 0, 1, 1, 1]
