"""The agent's sender and repair built from the few parts they use, without an AgentCore or
Ray: a real version table and real arenas, a scripted coordinator and transport."""

from __future__ import annotations

import dataclasses
import threading
import uuid

import pytest
import torch

from memsnap.coding.codec import codec_for
from memsnap.config import SnapshotConfig
from memsnap.errors import PushCancelled
from memsnap.localcluster import wait_for
from memsnap.memory.arena import MemoryBudget
from memsnap.node.repair import Repair
from memsnap.node.sender import Sender
from memsnap.node.slots import Slots
from memsnap.node.versions import COMMITTED, FAILED, READY, SlotPolicy, Versions
from memsnap.records import NodeReady, RankSource, Region
from memsnap.state.capture import capture
from memsnap.state.manifest import Manifest
from memsnap.transport.base import ChunkKey

NODE = "a" * 56
HOLDERS = ("h0", "h1", "h2")


class Parts:
    """A node's version table and arenas, as an AgentCore composes them."""

    def __init__(self, local_copy: bool):
        self.cfg = SnapshotConfig(
            f"parts-{uuid.uuid4().hex[:8]}", k=2, m=1, keep=2, memory_budget=1 << 22, local_copy=local_copy
        )
        self.lock, self.counters = threading.RLock(), {"pushed_bytes": 0, "repaired_chunks": 0}
        self.budget = MemoryBudget(self.cfg.memory_budget, NODE)
        self.versions = Versions(SlotPolicy.of(self.cfg), self.cfg.slots, self.cfg.keep, self.counters)
        self.slots = Slots(self.cfg, NODE, self.budget, self.lock, self.versions, lambda s: False)
        self.infos: dict = {}
        self.called: list[tuple] = []
        self.told: list[tuple] = []
        self.pushed: dict[int, list] = {}
        self.push_error: Exception | None = None

    def call(self, method, *args):
        self.called.append((method, *args))
        if method == "node_holders":
            return {"holders": list(HOLDERS), "addrs": [{"j": j} for j in range(3)], "epoch": 1}
        return None

    def push(self, addr, items, timeout, cancel=None):
        if self.push_error is not None:
            raise self.push_error
        for key, _ in items:  # as the transports do: ``cancel`` asked before each chunk
            if cancel is not None and cancel():
                raise PushCancelled(f"push to h{addr['j']} called off at chunk {key}")
            self.pushed.setdefault(addr["j"], []).append(key)
            self.on_chunk(addr["j"], cancel)

    def on_chunk(self, j: int, cancel) -> None:
        """A chunk was pushed to holder ``j`` (a test's hook)."""

    def sender(self) -> Sender:
        transport = type("Transport", (), {"push": staticmethod(lambda *a, **kw: self.push(*a, **kw))})()
        return Sender(
            node=NODE,
            cfg=self.cfg,
            lock=self.lock,
            versions=self.versions,
            slots=self.slots,
            transport=transport,
            codec=codec_for(2, 1),
            budget=self.budget,
            counters=self.counters,
            infos=self.infos,
            call=self.call,
            tell=lambda *a: self.told.append(a),
            call_all=lambda nodes, method, *a, timeout: {n: None for n in nodes},
            world=lambda: 4,
        )

    def repair(self) -> Repair:
        return Repair(
            node=NODE,
            cfg=self.cfg,
            lock=self.lock,
            versions=self.versions,
            slots=self.slots,
            infos=self.infos,
            store=None,
            transport=None,
            codec=None,
            budget=self.budget,
            counters=self.counters,
            agent=lambda node: None,
            gen=lambda: 3,
        )

    def queued(self, step: int):
        """Rank 0 captured a small state into a slot for ``step``: its version is queued."""
        man, raw = capture({"w": torch.arange(1024, dtype=torch.float32)}, rng=False)
        slot = self.slots.free_slot(step)
        assert slot is not None
        v = self.versions.begin(step, slot)
        self.slots.arena(0, v.slot, man.nbytes).view(0, man.nbytes)[:] = raw
        self.versions.add_rank(v, 0, man.nbytes)
        assert self.versions.captured(v, 0, man.to_json().decode(), [0])
        return v, man


@pytest.fixture(params=[True, False], ids=["local", "lean"])
def parts(request):
    p = Parts(local_copy=request.param)
    yield p
    p.slots.close_all()


def test_a_queued_version_is_sent_to_every_holder_and_reported(parts):
    v, man = parts.queued(1)
    parts.sender().send(v, [0])
    assert v.state is READY and parts.infos[1].holders == HOLDERS and parts.infos[1].world == 4
    assert parts.called == [("node_holders", NODE), ("node_ready", parts.infos[1].to_wire())]
    assert sorted(parts.pushed) == [0, 1, 2] and parts.counters["pushed_bytes"] >= man.nbytes * 3 // 2
    assert all(
        key.step == 1 and key.owner == NODE and key.shard == j for j, keys in parts.pushed.items() for key in keys
    )
    assert Manifest.from_json(v.manifests[0]).to_json() != man.to_json()  # its checksums are filled
    # lean mode without a spill: the arena gives its pages back once every chunk is acknowledged
    assert parts.slots.arenas[(0, v.slot)].resident is parts.cfg.local_copy


def test_a_send_that_fails_fails_the_version_tells_the_coordinator_and_forgets_the_layout(parts):
    v, _ = parts.queued(1)
    sender = parts.sender()
    parts.push_error = ConnectionError("holder h1 is gone")
    sender.send(v, [0])
    assert v.state is FAILED and parts.counters["failed_snapshots"] == 1 and sender.holders is None
    assert parts.told == [("node_failed", 1, NODE, "ConnectionError: holder h1 is gone")]
    assert [c[0] for c in parts.called] == ["node_holders"] and 1 not in parts.infos


def test_a_version_replaced_while_it_waited_is_not_sent(parts):
    v, _ = parts.queued(1)
    step = 1
    while v.state == "queued":  # newer captures take the free slots, then the queued one's
        step += 1
        parts.versions.begin(step, parts.versions.free_slot(step, lambda s: False))
    assert v.state == "superseded" and 1 not in parts.versions
    parts.sender().send(v, [0])
    assert parts.called == [] and parts.pushed == {} and parts.told == []


def test_a_version_given_up_while_it_is_sent_stops_at_its_next_chunk_and_reports_nothing(parts):
    """A restore plan rolls the job back below the step being sent: its pushes stop at once
    (not a failure), and the step is neither reported ready nor failed."""
    parts.cfg = dataclasses.replace(parts.cfg, chunk=256)  # several chunks per holder
    v, _ = parts.queued(1)
    sender = parts.sender()

    def given_up_at_the_first_chunk(j, cancel):
        with parts.lock:
            parts.versions.abandoned(1, "the job rolls back to step 0", failed=False)

    parts.on_chunk = given_up_at_the_first_chunk
    sender.send(v, [0])
    pushed = sum(len(keys) for keys in parts.pushed.values())
    assert 1 <= pushed <= 3, f"{pushed} chunks pushed after the version was given up at the first"
    assert 1 not in parts.versions and v.state is not FAILED and parts.counters["failed_snapshots"] == 0
    assert [c[0] for c in parts.called] == ["node_holders"] and parts.told == [] and 1 not in parts.infos
    assert sender.holders is not None  # nothing failed: the layout is still good


def test_a_failed_push_stops_the_pushes_to_the_other_holders_and_is_the_error_reported(parts):
    parts.cfg = dataclasses.replace(parts.cfg, chunk=256)
    v, _ = parts.queued(1)
    sender = parts.sender()
    push = parts.push

    def holder_1_fails(addr, items, timeout, cancel=None):
        if addr["j"] == 1:
            raise ConnectionError("holder h1 is gone")
        push(addr, items, timeout, cancel)

    def until_called_off(j, cancel):  # the others wait, after one chunk, for h1's failure
        wait_for(cancel, timeout=30, what=f"holder {j}'s push to be called off")

    parts.push, parts.on_chunk = holder_1_fails, until_called_off
    sender.send(v, [0])
    # h0 stopped after its first chunk; h2's parity stopped there too, or was never encoded
    assert len(parts.pushed[0]) == 1 and len(parts.pushed.get(2, [])) <= 1
    assert v.state is FAILED and parts.told == [("node_failed", 1, NODE, "ConnectionError: holder h1 is gone")]


def _gather(fill: bytes):
    def gather(peers, src, out):
        assert peers.transport is None and peers.codec is None  # the repair's own data plane
        out[:] = fill * (len(out) // len(fill))
        return {"repaired": 2}

    return gather


def source(step: int) -> RankSource:
    return RankSource(step, 2, 1, "n0", 2048, Region(0, 4096, 0), HOLDERS, (None,) * 3)


def test_a_recovered_rank_is_committed_here_and_a_lean_node_frees_the_slot_at_once(parts, monkeypatch):
    import memsnap.coding.restore

    repair = parts.repair()
    repair.hold_manifests(7, "n0", NodeReady(7, "n0", 0, 2048, (Region(0, 4096, 0),), HOLDERS).to_wire(), {0: "{}"})
    monkeypatch.setattr(memsnap.coding.restore, "gather", _gather(b"r"))
    got = repair.recover(7, 0, source(7))
    assert got["manifest"] == "{}" and got["nbytes"] == 4096 and parts.counters["repaired_chunks"] == 2
    with open(got["path"], "rb") as f:
        assert f.read(4096) == b"r" * 4096  # (lean mode too: the rank reads the arena now)
    if parts.cfg.local_copy:
        assert parts.versions.holds(7, 0) and repair.manifest_for(7, 0, source(7)) == "{}"
        parts.infos[7] = NodeReady(7, NODE, 0, 2048, (Region(0, 4096, 0),), HOLDERS)
        view, _ = repair.serve_own(ChunkKey(7, NODE, 0, 1))  # this node's own copy serves a rank that moved
        assert bytes(view) == b"r" * 2048
    else:
        assert parts.versions == {} and parts.versions.free_slots() == [0]


def test_a_rebuilt_local_copy_comes_in_committed_in_the_current_generation(parts, monkeypatch):
    import memsnap.coding.restore

    repair = parts.repair()
    repair.hold_manifests(8, "n0", NodeReady(8, "n0", 0, 2048, (Region(0, 4096, 0),), HOLDERS).to_wire(), {0: "m"})
    monkeypatch.setattr(memsnap.coding.restore, "gather", _gather(b"b"))
    assert repair.rebuild_local(8, 0, source(8)) is True
    v = parts.versions[8]
    assert v.state is COMMITTED and v.gen == 3 and parts.versions.holds(8, 0) and v.manifests == {0: "m"}
    assert repair.rebuild_local(8, 0, source(8)) is False  # already held
    assert parts.budget.used == 4096


class DeviceParts:
    """An ``AgentDevice`` on the CPU backend over ``parts``' real arenas: drains run inline."""

    def __init__(self, parts: Parts):
        from memsnap.device.runtime import AgentDevice

        self.parts = parts
        self.handed_on: list[tuple] = []
        self.failures: list[tuple[int, str]] = []
        self.dropped: set[int] = set()
        self.device = AgentDevice(
            NODE,
            parts.cfg.job,
            "cpu",
            1 << 20,
            submit=lambda fn, *args: fn(*args),
            arena=self.arena,
            captured=lambda *args: self.handed_on.append(args),
            failed=lambda step, why: self.failures.append((step, why)),
        )

    def arena(self, step: int, rank: int):
        v = self.parts.versions.get(step)
        if step in self.dropped or v is None:
            return None
        return self.parts.slots.arena(rank, v.slot, v.sizes[rank]), v.sizes[rank]

    def capture(self, step: int, state: dict) -> tuple[Manifest, str]:
        """A rank's side: the step's host slot begun, then the state captured into its
        device buffer and reported done."""
        from memsnap.device.backend import BufferHandle
        from memsnap.device.cpu import CpuBackend
        from memsnap.device.tier import RankTier
        from memsnap.state import capture as cap

        manifest, sources = cap.plan_sources(state, rng=False)
        slot = self.parts.slots.free_slot(step)
        assert slot is not None
        v = self.parts.versions.begin(step, slot)
        self.parts.versions.add_rank(v, 0, manifest.nbytes)
        self.parts.slots.arena(0, v.slot, manifest.nbytes)
        handle = self.device.begin(step, 0, "cpu", manifest.nbytes)
        assert handle is not None
        tier = RankTier(CpuBackend())
        assert tier.capture(BufferHandle.from_json(handle), manifest, sources, on_done=lambda: None)
        tier.wait()
        tier.close()
        return manifest, manifest.to_json().decode()


@pytest.fixture
def device(parts):
    d = DeviceParts(parts)
    yield d
    d.device.close()


def test_the_device_tier_drains_a_capture_into_the_steps_arena_and_hands_it_on(device):
    state = {"w": torch.arange(2048, dtype=torch.float32)}
    manifest, mjson = device.capture(5, state)
    device.device.captured(5, 0, "cpu", mjson, [0])
    assert device.handed_on == [(5, 0, mjson, [0])] and device.failures == []
    arena, n = device.arena(5, 0)
    got = Manifest.from_json(mjson, "test")
    assert n == manifest.nbytes and bytes(arena.view(0, n))[: got.nbytes] == bytes(
        memoryview(state["w"].numpy()).cast("B")
    )
    held = device.device.source(0, 5)
    assert held is not None and held[0] == mjson  # a restore of step 5 may read the device copy
    assert device.device.source(0, 4) is None


def test_a_step_dropped_before_its_drain_is_handed_on_undrained(device):
    _, mjson = device.capture(6, {"w": torch.ones(64)})
    device.dropped.add(6)  # abandoned meanwhile: the host path drops it as it drops a capture
    device.device.captured(6, 0, "cpu", mjson, [0])
    assert device.handed_on == [(6, 0, mjson, [0])] and device.failures == []


def test_a_drain_that_fails_fails_the_step_and_hands_nothing_on(device, monkeypatch):
    _, mjson = device.capture(7, {"w": torch.ones(64)})

    def broken(*args):
        raise OSError("device lost")

    monkeypatch.setattr(device.device.tier, "drain", broken)
    device.device.captured(7, 0, "cpu", mjson, [0])
    assert device.handed_on == [] and device.failures == [
        (7, "rank 0: device buffer drain failed: OSError: device lost")
    ]
