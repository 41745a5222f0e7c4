"""Cells of the fault matrix (docs/failures.md) that need their own test, without Ray: the coordinator
lost between the two phases of a commit, an agent killed in the middle of a spill, a node
lost while a step is encoded, and a spare node lost. All run the real code
(``CoordinatorCore`` + ``rebuild_state`` over real ``AgentCore``s; the agent's spill thread
in a process that dies half way through a file; a whole job in one process with its TCP data
plane on loopback, ``support.inproc``)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING, cast

import pytest
import torch
from support.inproc import EncodeGate, Face, Job, model_state

from memsnap.config import SnapshotConfig
from memsnap.durable.storage import Store
from memsnap.job.coordinator import CoordinatorCore, adopt_late, rebuild_state
from memsnap.localcluster import wait_for
from memsnap.node.agent import AgentCore
from memsnap.records import NodeReady, Region

if TYPE_CHECKING:
    from memsnap.directory import Directory

SECRET = b"c" * 32
NODES = [f"{c}" * 56 for c in "abcd"]


class Agents:
    """The coordinator's view of the job's agents: in-process ``AgentCore``s by node."""

    def __init__(self, cores: dict[str, AgentCore]):
        self.cores = cores

    def alive(self) -> set[str]:
        return set(self.cores)

    def call_all(self, nodes, method, *args, timeout):
        out = {}
        for node in nodes:
            attr = getattr(Face(self.cores[node]), method)  # what the agent's actor does with the call
            answer = attr(*args) if callable(attr) else attr
            # records cross the Ray face as their wire form, as the agent's actor sends them
            out[node] = answer.to_wire() if hasattr(answer, "to_wire") else answer
        return out

    def agent(self, node):
        return None


@pytest.fixture
def agents():
    cfg = SnapshotConfig("fault-cells", k=2, m=1, memory_budget=1 << 20)
    cores = {n: AgentCore(cfg.to_dict(), n, SECRET) for n in NODES}
    yield cfg, cores
    for core in cores.values():
        core.shutdown()


def coordinator(cfg, cores) -> CoordinatorCore:
    # Agents answers the directory's calls from in-process agents
    core = CoordinatorCore(cfg.to_dict(), len(NODES), directory=cast("Directory", Agents(cores)))
    core.broadcast = lambda *args: None  # type: ignore[method-assign]  # phase two is delivered by hand below
    return core


def joined(cfg, cores) -> CoordinatorCore:
    """A coordinator every node joined with its one rank (rank i on node i)."""
    core = coordinator(cfg, cores)
    for i, node in enumerate(NODES):
        core.join(node, {"port": i}, [i])
    return core


def sent(cores, step: int) -> list[dict]:
    """Every agent has sent ``step`` (phase one done on its side): its NodeReady, for the coordinator."""
    reports = []
    for i, (node, core) in enumerate(cores.items()):
        holders = tuple(NODES[(i + 1 + j) % 4] for j in range(3))
        info = NodeReady(step, node, 0, 4096, (Region(i, 4096, 0),), holders)
        v = core.versions.begin(step, 0)  # captured, sent, every chunk acknowledged: ready
        core.versions.add_rank(v, i, 4096)
        assert core.versions.captured(v, i, "{}", [i]) and core.versions.sending(v) and core.versions.sent(v)
        core.infos[step] = info
        core.ranks.add(i)
        reports.append(info.to_wire())
    return reports


def test_a_coordinator_lost_before_phase_two_leaves_the_step_uncommitted_and_the_next_commits(agents):
    cfg, cores = agents
    first = joined(cfg, cores)
    reports = sent(cores, 5)
    for rep in reports[:3]:  # three of four nodes ready: then the coordinator dies
        first.node_ready(rep)
    assert first.newest() is None
    second = coordinator(cfg, cores)
    rebuild_state(second)  # from the agents: nothing of step 5 was committed anywhere
    assert second.newest() is None and sorted(second.membership.members) == [0, 1, 2, 3]
    for rep in sent(cores, 6):  # the job goes on: the next step commits on the new coordinator
        second.node_ready(rep)
    assert second.newest() == 6 and second.resolved(5)  # wait(5) returns (6 is newer)


class BusyAtFirst(Agents):
    """One agent is too busy to answer the rebuild's first call (its threads all wait on the
    coordinator being rebuilt), then answers."""

    def __init__(self, cores, busy: str):
        super().__init__(cores)
        self.busy, self.calls = busy, 0

    def call_all(self, nodes, method, *args, timeout):
        self.calls += 1
        return super().call_all([n for n in nodes if n != self.busy or self.calls > 1], method, *args, timeout=timeout)

    def agent(self, node):
        return self.cores[node]


def test_an_agent_the_rebuild_missed_joins_when_it_answers_and_hears_the_next_commit(agents):
    """Left out, a busy node would get no commit notice again: its ranks would never commit a
    step locally, and a later restore would read them from peers (or not at all)."""
    cfg, cores = agents
    first = joined(cfg, cores)
    for rep in sent(cores, 5):
        first.node_ready(rep)
    second = CoordinatorCore(cfg.to_dict(), len(NODES), directory=BusyAtFirst(cores, NODES[2]))
    told = []
    second.broadcast = lambda *args: told.append((args, second.membership.live_nodes()))
    missing = rebuild_state(second)
    assert missing == [NODES[2]] and 2 not in second.membership.members
    assert adopt_late(second, missing, within_s=30) == []
    assert second.membership.members[2] == NODES[2] and NODES[2] in second.membership.live_nodes()
    for rep in sent(cores, 6):
        second.node_ready(rep)
    (((method, _), nodes),) = [t for t in told if t[0][0] == "commit"]
    assert second.newest() == 6 and NODES[2] in nodes


def test_a_coordinator_lost_during_phase_two_keeps_the_commit_some_agents_heard(agents):
    cfg, cores = agents
    first = joined(cfg, cores)
    for rep in sent(cores, 7):
        first.node_ready(rep)
    record = first.log.records[7]
    notice = first.log.notice(record)
    for node in NODES[:2]:  # phase two reached two agents, then the coordinator died
        cores[node].commit(notice)
    assert [7 in cores[n].committed for n in NODES] == [True, True, False, False]
    second = coordinator(cfg, cores)
    rebuild_state(second)
    assert second.newest() == 7, "a step an agent heard committed is committed"
    # the agents that missed phase two hear it from the rebuilt coordinator: a restore of step 7
    # reads every rank from its own node's RAM
    assert all(7 in cores[n].committed and cores[n].versions[7].state == "committed" for n in NODES)
    assert sorted(second.log.records[7].ranks) == [0, 1, 2, 3]
    assert second.log.records[7].holders(NODES[0]) == record.holders(NODES[0])


def test_a_rebuilt_coordinator_knows_which_run_holds_each_rank_and_what_run_spilled_a_step(agents, tmp_path):
    """The coordinator is lost: the one rebuilt from the agents still refuses a second live run,
    and a step the first run took is spilled naming that run, even after another took over."""
    from dataclasses import replace

    from memsnap.identity import process_token
    from memsnap.state.capture import capture

    cfg, cores = agents
    cfg = replace(cfg, spill=str(tmp_path / "spill"))
    live = process_token()  # the ranks of run trial-a are this (live) process
    first = CoordinatorCore(cfg.to_dict(), 4, directory=Agents(cores))
    first.broadcast = lambda *args: None
    for i, node in enumerate(NODES):
        cores[node].joined(i, 4, {"run": "trial-a", "process": live})
        first.join(node, {"port": i}, [i], 4, {i: {"run": "trial-a", "process": live}})
    for rep in sent(cores, 7):
        first.node_ready(rep)
    second = CoordinatorCore(cfg.to_dict(), 4, directory=Agents(cores))
    rebuild_state(second)
    assert second.run == "trial-a" and second.membership.holders[2].node == NODES[2]
    assert second.membership.holders[2].process == live
    got = second.join(NODES[0], {"port": 0}, [0], 4, {0: {"run": "trial-b", "process": "1-1"}})
    assert "held by run 'trial-a', still running" in got.refused[0]
    gone = {r: {"run": "trial-b", "process": "1-1"} for r in range(4)}  # pid 1, started at tick 1: no such process
    first.running_holders = lambda holders: set()  # trial-a's processes have exited
    assert first.join(NODES[0], {"port": 0}, [0, 1, 2, 3], 4, gone).refused == {} and first.run == "trial-b"
    store = Store.open(cfg.spill)
    man, raw = capture({"w": torch.ones(4)})
    for rank in range(4):
        store.write_rank(7, rank, man, raw)
    assert first.spilled(7, [0, 1, 2, 3])
    assert store.marker(7)["metadata"]["run"] == "trial-a"


SPILL_AND_DIE = """
import os, sys, threading, types
import torch
from memsnap import naming
from memsnap.memory.arena import Arena
from memsnap.state.capture import capture
from memsnap.config import SnapshotConfig
from memsnap.node.slots import Version
from memsnap.node.spill import Spiller
from memsnap.durable.storage import Store

uri = sys.argv[1]
state = {{"model": torch.nn.Linear(2048, 5120)}}  # 40 MiB: the data file takes three writes
torch.manual_seed(2)
man, raw = capture(state)
arena = Arena.create(naming.arena_path("spill-kill", "e" * 56, 0, 0, 0), man.nbytes)
arena.view(0, man.nbytes)[:] = raw
original = Store._write
def dying(self, path, *args):  # the agent dies half way through the data file
    def halfway(done, total):
        if done >= total // 2:
            arena.close(unlink=True)
            os._exit(9)
    *rest, progress = args  # (the progress callback is _write's last argument)
    return original(self, path, *rest, halfway if path.endswith(".bin") else progress)
Store._write = dying
core = types.SimpleNamespace(node="n0", lock=threading.RLock(), arenas={{(0, 0): arena}},
                             versions={{2: Version(2, 0, "committed", {{0: man.nbytes}}, {{0: man.to_json().decode()}})}},
                             cfg=SnapshotConfig("spill-kill", spill=uri, spill_every=1))
Spiller.of(core, report=lambda step, ranks: Store.open(uri).commit(step, 1)).committed(2, due=True)
threading.Event().wait(120)
sys.exit("the spill finished: it was meant to die half way")
"""


def test_an_agent_killed_mid_spill_leaves_the_previous_durable_step_and_the_next_spill_works(tmp_path):
    import memsnap

    uri = str(tmp_path / "spill")
    memsnap.save(uri, {"model": torch.nn.Linear(2048, 5120)}, 1, weights_only=True)  # step 1 is durable
    run = subprocess.run(
        [sys.executable, "-c", SPILL_AND_DIE.format(), uri], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 9, run.stderr[-2000:]
    store = Store.open(uri)
    assert store.latest() == 1 and store.steps() == [1]  # step 2's half-written files do not exist for readers
    fresh = {"model": torch.nn.Linear(2048, 5120)}
    with pytest.warns(UserWarning, match="optimizer"):
        assert memsnap.load(uri, fresh) == 1
    torch.manual_seed(2)
    again = {"model": torch.nn.Linear(2048, 5120)}
    memsnap.save(uri, again, 2, weights_only=True)  # the next attempt at step 2 writes over the debris
    assert store.latest() == 2
    with pytest.warns(UserWarning, match="optimizer"):
        assert memsnap.load(uri, fresh) == 2
    assert torch.equal(fresh["model"].weight, again["model"].weight)


# --- a whole job in one process (support.inproc) -------------------------------------------------
A, B, C, D, E = (c * 56 for c in "abcde")


@pytest.fixture
def inproc(monkeypatch):
    """Jobs made by ``inproc(ranks)``; re-protection runs at once (no restore to wait for) and
    its calls to agents are answered in-process."""
    import memsnap.job.reprotect
    import memsnap.node.repair

    monkeypatch.setenv("MEMSNAP_REPROTECT_DEFER_S", "0")
    monkeypatch.setattr(memsnap.job.reprotect, "ray", Job.ray)
    monkeypatch.setattr(memsnap.node.repair, "ray", Job.ray)
    jobs = []

    def make(ranks):
        jobs.append(Job(ranks, k=2, m=1, keep=2, memory_budget=8 << 20, chunk=1024))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def reprotected(job) -> None:
    """Until re-protection has rebuilt shards and its thread has ended (it may start only after
    the step that set it off is already resolved)."""
    state = job.coord.reprotect.state
    wait_for(
        lambda: state.rebuilt_chunks > 0 and not state.running,
        timeout=60,
        what="re-protection to rebuild the lost node's shards",
    )


def assert_whole(job, step: int, nodes) -> int:
    """Every rank's bytes of ``step``, read from its holders as a peer restore reads them, and
    the local copies on ``nodes``, are bitwise what was captured; the stripes it had to decode."""
    decoded = 0
    for rank, want in job.saved[step].items():
        got, stats = job.read_from_holders(step, rank)
        assert got == want, f"rank {rank}'s step {step} read from its holders differs from what it captured"
        decoded += stats["decoded_stripes"]
    for node in nodes:
        for rank in job.ranks[node]:
            assert job.local_copy(node, step, rank) == job.saved[step][rank]
    return decoded


def test_a_node_lost_while_a_step_is_encoded_fails_it_by_node_failed_and_the_previous_step_restores(inproc):
    job = inproc({A: [0], B: [1], C: [2], D: [3]})
    states = {r: model_state(r) for r in range(4)}
    job.save(1, states)
    job.resolved(1)
    assert job.coord.newest() == 1
    lost = job.coord.membership.placement.holders[A][2]  # the holder of A's parity: pushed after encoding
    others, survivors = [B, C, D], [n for n in (A, B, C, D) if n != lost]
    gate = EncodeGate(job.cores[A])
    job.save(2, {r: model_state(10 + r) for r in range(4)})
    assert gate.reached.wait(60), "node A never began encoding step 2"
    wait_for(
        lambda: all(job.cores[n].versions[2].state == "ready" for n in others),
        timeout=60,
        what="every other node to have sent step 2",
    )  # so A is the one that meets the loss
    job.lose(lost)
    gate.release()
    job.resolved(2)
    assert job.coord.newest() == 1, "a step whose encoder lost a holder never commits"
    why = job.coord.log.failed[2]
    assert why.startswith(f"node {A[:12]}: TransportError: push to") and "shard=2" in why
    assert job.cores[A].counters["failed_snapshots"] == 1
    for core in job.live().values():  # every node dropped step 2: no version, no held chunk
        assert 2 in core.abandoned and 2 not in core.versions and 2 not in core.store.inventory()
    assert assert_whole(job, 1, survivors) > 0  # the lost holder's shards were decoded
    placement = job.coord.membership.placement
    assert job.coord.membership.peered and lost in placement.holders  # its slot waits for its rank
    job.start_agent(E)  # the lost node's rank comes back on a new node, in its slot
    job.join(E, job.ranks[lost])
    job.cores[E].placed(job.coord.answer(E))
    assert job.coord.membership.placement.holders[E] == placement.holders[lost]
    reprotected(job)  # the lost node's shards of step 1 are rebuilt on the new one
    assert all(lost not in job.coord.log.records[1].holders(o) for o in job.coord.log.records[1].nodes)
    job.layouts_current()
    job.save(3, states)
    job.resolved(3)
    assert job.coord.newest() == 3
    record = job.coord.log.records[3]
    assert sorted(record.nodes) == sorted(survivors + [E]) and all(lost not in record.holders(o) for o in record.nodes)
    assert_whole(job, 3, survivors + [E])


def test_a_rank_that_joins_without_a_restore_round_takes_the_jobs_generation_and_its_steps_commit(inproc):
    """A standby that takes a survivor's live state joins a running job with no restore round
    of its own: the join brings its node's agent the job's restore generation, or every step it
    sends would be ignored as older than the last restore and no step would commit again."""
    job = inproc({A: [0], B: [1], C: [2], D: [3]})
    job.coord.log.resume(None)  # the job's first restore round (a fresh start): generation 1
    for core in job.cores.values():
        core.resume(None, job.coord.log.gen)
    states = {r: model_state(r) for r in range(4)}
    job.save(1, states)
    job.resolved(1)
    assert job.coord.newest() == 1
    job.lose(D)
    job.start_agent(E)  # the standby's node: a new agent, of restore generation 0
    job.join(E, job.ranks[D])
    job.cores[E].placed(job.coord.answer(E))
    assert job.cores[E].gen == job.coord.log.gen == 1
    job.layouts_current()
    for step in (2, 3):  # (two in a row: no slot stays held by a step that never commits)
        job.save(step, states)
        job.resolved(step)
        assert job.coord.newest() == step, f"step {step}: {job.coord.log.failed.get(step)}"
    assert sorted(job.coord.log.records[3].nodes) == sorted([A, B, C, E])


def test_a_spare_node_lost_leaves_every_step_restorable_and_reprotection_rebuilds_its_shards(inproc):
    job = inproc({A: [0], B: [1], C: [2], D: [], E: []})  # D and E: spare agents, no rank
    spare = D
    states = {r: model_state(r) for r in range(3)}
    job.save(1, states)
    job.resolved(1)
    assert job.coord.newest() == 1 and job.coord.status()["protection"] == {"0": 2}
    record = job.coord.log.records[1]
    assert sorted(o for o in record.nodes if spare in record.holders(o)) == [A, B, C]
    job.lose(spare)
    assert job.coord.status()["protection"] == {"0": 1}
    assert assert_whole(job, 1, (A, B, C)) > 0  # restorable: the spare's data shards decoded from parity
    job.save(2, states)  # the first push to the lost spare fails the step, as a lost holder's does
    job.resolved(2)
    assert job.coord.newest() == 1 and "TransportError: push to" in job.coord.log.failed[2]
    assert spare not in job.coord.membership.placement.holders  # placed anew on the live nodes
    reprotected(job)
    assert not job.coord.reprotect.status()["errors"]
    assert job.coord.status()["protection"] == {"0": 2}, "the protection level came back"
    record = job.coord.log.records[1]
    assert all(spare not in record.holders(o) for o in record.nodes)
    assert assert_whole(job, 1, (A, B, C)) == 0  # every shard at a live holder again: nothing to decode
    job.layouts_current()
    job.save(3, states)
    job.resolved(3)
    assert job.coord.newest() == 3 and all(spare not in job.coord.log.records[3].holders(o) for o in (A, B, C))
    assert_whole(job, 3, (A, B, C))


def test_reprotection_takes_the_newest_step_first_and_drops_a_step_pruned_meanwhile(inproc, monkeypatch):
    """After a loss, the newest committed step (the one a second loss restores) is re-protected
    first; an older step that newer commits prune meanwhile (``keep=2``) is dropped, not rebuilt
    and not counted as an error."""
    import threading

    job = inproc({A: [0], B: [1], C: [2], D: [], E: []})  # D and E: spare agents, no rank
    states = {r: model_state(r) for r in range(3)}
    for step in (1, 2):
        job.save(step, states)
        job.resolved(step)
    assert sorted(job.coord.log.records) == [1, 2]
    on_d = sum(D in job.coord.log.records[2].holders(o) for o in job.coord.log.records[2].nodes)
    assert on_d > 0, "the spare to be lost holds shards of step 2"
    rp = job.coord.reprotect
    rebuild_on, order, go_on = rp._rebuild_on, [], threading.Event()

    def held_at_first(record, owner, j, new, addrs):
        order.append(record.step)
        if len(order) == 1:  # the job goes on while the first shard is rebuilt
            assert go_on.wait(60), "the test never let re-protection go on"
        return rebuild_on(record, owner, j, new, addrs)

    monkeypatch.setattr(rp, "_rebuild_on", held_at_first)
    job.lose(D)
    job.save(3, states)  # its push to the lost spare fails it; the live nodes are placed anew
    job.resolved(3)
    assert "TransportError: push to" in job.coord.log.failed[3]
    wait_for(lambda: order, timeout=60, what="re-protection to begin")
    job.layouts_current()
    job.save(4, states)
    job.resolved(4)
    assert sorted(job.coord.log.records) == [2, 4], "step 4's commit pruned step 1 (keep=2)"
    go_on.set()
    reprotected(job)
    record = job.coord.log.records[2]
    assert order == [2] * on_d, "only step 2's shards were rebuilt, and it went first"
    assert rp.status()["dropped"] == 1 and not rp.status()["errors"]
    assert all(D not in record.holders(o) for o in record.nodes)
    assert assert_whole(job, 2, (A, B, C)) == 0  # every shard of step 2 at a live holder again


def test_a_restore_plan_gives_up_the_steps_above_it_and_a_send_of_one_stops(inproc):
    """The job restores step 1 while step 2 is still sent (node A's parity not yet encoded, the
    others ready): no node goes on sending step 2 while the ranks restore, it never commits, it
    is no failure, and once the job resumes from step 1, step 2 taken again commits."""
    from memsnap.errors import PushCancelled
    from memsnap.records import RankRestore

    job = inproc({A: [0], B: [1], C: [2], D: [3]})
    states = {r: model_state(r) for r in range(4)}
    job.save(1, states)
    job.resolved(1)
    pushes, real_push = [], job.cores[A].transport.push

    def watched(peer, items, *, timeout, cancel=None):
        try:
            real_push(peer, items, timeout=timeout, cancel=cancel)
        except PushCancelled:
            pushes.append("called off")
            raise
        pushes.append("done")

    job.cores[A].transport.push = watched  # the real method, watched
    gate = EncodeGate(job.cores[A])
    job.save(2, {r: model_state(10 + r) for r in range(4)})
    assert gate.reached.wait(60), "node A never began encoding step 2"
    wait_for(
        lambda: all(job.cores[n].versions[2].state == "ready" for n in (B, C, D)),
        timeout=60,
        what="every other node to have sent step 2",
    )
    assert 2 in job.coord.log.pending
    job.coord.restore_arrive(0, [0, 1, 2, 3])  # every rank is in the restore round: the plan
    plan = job.coord.plan(0)
    assert plan.step == 1 and 2 not in job.coord.log.pending and 2 in job.coord.log.skipped
    for core in job.cores.values():  # what each node's relay does as its ranks hear the plan
        assert core.roll_back(plan.step) == [2]
    gate.release()
    wait_for(lambda: "called off" in pushes, timeout=60, what="node A's parity push of step 2 to be called off")
    job.resolved(2)
    assert job.coord.newest() == 1 and 2 not in job.coord.log.failed
    for core in job.cores.values():  # nothing of step 2 left anywhere, and nothing failed
        assert 2 not in core.versions and 2 not in core.store.inventory()
        assert core.counters["failed_snapshots"] == 0
    job.coord.restore_report(0, {r: RankRestore.loaded("local", {}) for r in range(4)})
    result = job.coord.restore_result(0)
    assert result.ok
    for core in job.cores.values():
        core.resume(plan.step, result.gen)
    job.save(2, states)
    job.resolved(2)
    assert job.coord.newest() == 2
    assert_whole(job, 2, (A, B, C, D))
