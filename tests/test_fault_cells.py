"""Cells of the fault matrix (README) that need their own test, without Ray: the coordinator
lost between the two phases of a commit, and an agent killed in the middle of a spill.
Both run the real code (``CoordinatorCore`` + ``rebuild_state`` over real ``AgentCore``s;
the agent's spill thread in a process that dies half way through a file)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from memsnap.agent import AgentCore
from memsnap.config import SnapshotConfig
from memsnap.coordinator import CoordinatorCore, rebuild_state
from memsnap.records import NodeReady, Region
from memsnap.slots import Version
from memsnap.storage import Store

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
            attr = getattr(self.cores[node], method)
            out[node] = attr(*args) if callable(attr) else attr
        return out

    def agent(self, node):
        return None


@pytest.fixture
def job():
    cfg = SnapshotConfig("fault-cells", k=2, m=1, memory_budget=1 << 20)
    cores = {n: AgentCore(cfg.to_dict(), n, SECRET) for n in NODES}
    yield cfg, cores
    for core in cores.values():
        core.shutdown()


def coordinator(cfg, cores) -> CoordinatorCore:
    core = CoordinatorCore(cfg.to_dict(), len(NODES), directory=Agents(cores))
    core.broadcast = lambda *args: None  # phase two is delivered by hand below
    return core


def sent(cores, step: int) -> list[dict]:
    """Every agent has sent ``step`` (phase one done on its side): its NodeReady, for the coordinator."""
    reports = []
    for i, (node, core) in enumerate(cores.items()):
        holders = tuple(NODES[(i + 1 + j) % 4] for j in range(3))
        info = NodeReady(step, node, 0, 4096, (Region(i, 4096, 0),), holders)
        core.versions[step] = Version(step, 0, "ready", {i: 4096}, {i: "{}"})
        core.infos[step] = info
        core.ranks.add(i)
        reports.append(info.to_wire())
    return reports


def test_a_coordinator_lost_before_phase_two_leaves_the_step_uncommitted_and_the_next_commits(job):
    cfg, cores = job
    first = coordinator(cfg, cores)
    for i, node in enumerate(NODES):
        first.join(node, {"port": i}, [i])
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


def test_a_coordinator_lost_during_phase_two_keeps_the_commit_some_agents_heard(job):
    cfg, cores = job
    first = coordinator(cfg, cores)
    for i, node in enumerate(NODES):
        first.join(node, {"port": i}, [i])
    for rep in sent(cores, 7):
        first.node_ready(rep)
    record = first.log.records[7]
    notice = first.log.notice(record)
    for node in NODES[:2]:  # phase two reached two agents, then the coordinator died
        cores[node].commit(notice)
    second = coordinator(cfg, cores)
    rebuild_state(second)
    assert second.newest() == 7, "a step an agent heard committed is committed"
    assert sorted(second.log.records[7].ranks) == [0, 1, 2, 3]
    assert second.log.records[7].holders(NODES[0]) == record.holders(NODES[0])


SPILL_AND_DIE = """
import os, sys, threading, types
import torch
from memsnap import naming
from memsnap.arena import Arena
from memsnap.capture import capture
from memsnap.config import SnapshotConfig
from memsnap.slots import Version
from memsnap.spill import Spiller
from memsnap.storage import Store

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
core = types.SimpleNamespace(lock=threading.RLock(), arenas={{(0, 0): arena}},
                             versions={{2: Version(2, 0, "committed", {{0: man.nbytes}}, {{0: man.to_json().decode()}})}},
                             cfg=SnapshotConfig("spill-kill", spill=uri, spill_every=1))
Spiller(core, report=lambda step, ranks: Store.open(uri).commit(step, 1)).committed(2, due=True)
threading.Event().wait(120)
sys.exit("the spill finished: it was meant to die half way")
"""


def test_an_agent_killed_mid_spill_leaves_the_previous_durable_step_and_the_next_spill_works(tmp_path):
    import memsnap

    uri = str(tmp_path / "spill")
    memsnap.save(uri, {"model": torch.nn.Linear(2048, 5120)}, 1, weights_only=True)  # step 1 is durable
    run = subprocess.run([sys.executable, "-c", SPILL_AND_DIE.format(), uri], capture_output=True, text=True,
                         timeout=180)
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
