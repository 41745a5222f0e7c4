"""A restore from peers inside the rank (receive.py), without Ray: real TCP holders, a real
codec, and a live model + optimizer that must end bitwise equal, received in place."""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import TYPE_CHECKING, cast

import pytest
import torch
from support import states
from support.holders import tcp_holders
from support.runtime import digest

from memsnap.coding import encode, receive
from memsnap.coding.codec import codec_for
from memsnap.coding.landing import Spans
from memsnap.coding.stripes import choose_chunk
from memsnap.config import SnapshotConfig
from memsnap.errors import StateMismatchError
from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import HeldChunks
from memsnap.records import RankPlan, RankRestore, RankSource, Region, RoundResult
from memsnap.state.capture import capture
from memsnap.transport import ChunkKey, make_transport

if TYPE_CHECKING:
    from memsnap.rank.client import AgentClient

SECRET = os.urandom(32)
K, M = 2, 1
OWNER = "node-a"


make_state = partial(states.make_state, widths=(96, 96, 7), warm=4, epoch=True)


@pytest.fixture(scope="module")
def holders():
    with tcp_holders(K + M, SECRET) as h:
        yield h


def publish(holders, state: dict, step: int, chunk_target: int = 4096) -> tuple[tuple[RankSource, str], str]:
    """Capture ``state`` as rank 0 of ``OWNER``, push its shards to the holders, return the record."""
    stores, addrs, client = holders
    man, buf = capture(state, checksums=True)
    chunk = choose_chunk(man.nbytes, K, chunk_target)
    region = encode.StripedRegion(0, man.nbytes, 0, K, chunk)
    enc = encode.Encoded(region, buf)
    codec = codec_for(K, M)
    parity = memoryview(bytearray(region.stripes * M * chunk))
    batch = encode.ParityBatch([(enc, s) for s in range(region.stripes)], M, chunk, parity)
    batch.encode(codec)
    for j in range(K + M):
        items = enc.items(step, OWNER, j) if j < K else batch.items(step, OWNER, j)
        client.push(addrs[j], items, timeout=60)
    source = RankSource(
        step, K, M, OWNER, chunk, Region(0, man.nbytes, 0), tuple(f"h{j}" for j in range(K + M)), tuple(addrs)
    )
    return (source, man.to_json().decode()), digest(state, rng=False)


def peers(holders) -> receive.Peers:
    return receive.Peers(holders[2], codec_for(K, M))


def pointers(state: dict) -> list[int]:
    return [p.data_ptr() for p in state["model"].parameters()] + [
        t.data_ptr() for s in state["optim"].state.values() for t in s.values()
    ]


def test_shards_land_in_the_live_tensors_and_the_state_is_bitwise_equal(holders):
    saved = make_state(1)
    record, want = publish(holders, saved, step=3)
    live = make_state(2)
    before = pointers(live)
    stats = receive.into_state(peers(holders), *record, live)
    assert digest(live, rng=False) == want and live["epoch"] == 1
    assert pointers(live) == before  # the parameters and moments were written where they are
    assert stats["in_place_bytes"] > 0.9 * sum(t.numel() * 4 for t in saved["model"].parameters()) * 3
    assert stats["decoded_stripes"] == 0 and stats["stripes"] > 10


def test_a_fresh_optimizer_adopts_new_tensors_received_whole(holders):
    """Before the first step an optimizer has no moments: they are received into new tensors."""
    record, want = publish(holders, make_state(3), step=4)
    live = make_state(4, warm=0)
    receive.into_state(peers(holders), *record, live)
    assert digest(live, rng=False) == want
    torch.manual_seed(0)
    live["model"](torch.randn(2, 96)).sum().backward()
    live["optim"].step()  # the adopted moments are the optimizer's own


def test_a_lost_holder_is_decoded_and_checked(holders):
    record, want = publish(holders, make_state(5), step=5)
    source, manifest = record
    dead = {"transport": "tcp", "host": "127.0.0.1", "port": 1}  # nobody listens there
    record = (dataclasses.replace(source, addrs=(dead, *source.addrs[1:])), manifest)
    live = make_state(6)
    stats = receive.into_state(peers(holders), *record, live)
    assert digest(live, rng=False) == want
    assert stats["decoded_stripes"] == stats["stripes"] and stats["decoded"]


def test_a_flipped_byte_in_a_held_chunk_is_rebuilt_and_repaired(holders):
    record, want = publish(holders, make_state(7), step=6)
    holders[0][1].flip_byte(ChunkKey(6, OWNER, 2, 1), 10)
    live = make_state(8)
    stats = receive.into_state(peers(holders), *record, live)
    assert digest(live, rng=False) == want
    assert stats["decoded_stripes"] == 1 and stats["repaired"] == 1
    again = make_state(9)
    assert receive.into_state(peers(holders), *record, again)["decoded_stripes"] == 0  # repaired on the holder


def test_a_mismatched_state_is_refused_before_any_byte_is_written(holders):
    record, _ = publish(holders, make_state(10), step=7)
    live = make_state(11, widths=(64, 64, 7))
    want = digest(live, rng=False)
    with pytest.raises(StateMismatchError):
        receive.into_state(peers(holders), *record, live)
    assert digest(live, rng=False) == want


def test_spans_cover_the_gaps_and_scatter_across_pieces():
    a, b = bytearray(10), bytearray(5)
    spans = Spans([(20, b), (4, a)], 30)
    assert isinstance(spans.view(4, 14), memoryview)  # inside one piece: no scatter
    scattered = spans.view(2, 22)  # gap 2..4, a, gap 14..20, b[:2]
    assert [len(p) for p in scattered.parts] == [2, 10, 6, 2]
    spans.write(0, bytes(range(30)))
    assert bytes(a) == bytes(range(4, 14)) and bytes(b) == bytes(range(20, 25))
    with pytest.raises(ValueError, match="overlaps"):
        Spans([(0, bytearray(8)), (4, bytearray(8))], 16)
    with pytest.raises(ValueError, match="past the stream"):
        Spans([(10, bytearray(8))], 16)
    with pytest.raises(IndexError):
        spans.view(25, 31)


class _Client:
    """The restore calls a Snapshotter makes through its node's agent (``rank.client``),
    answered from a script of plans."""

    rank = 0

    def __init__(self, plans: list[dict]):
        self.plans = list(plans)
        self.done: list[bool] = []

    def restore_plan(self, attempt: int):
        return RankPlan.from_wire(self.plans[attempt])

    def manifest(self, step, rank, source) -> str:
        return "{}"

    def restore_done(self, attempt: int, report: RankRestore):
        self.done.append(report.ok)
        return RoundResult(report.ok, {}, 1)

    def ready_slots(self, nbytes: int) -> None:
        pass


def _snapshotter(plans: list[dict], fail_with: Exception, monkeypatch):
    """A Snapshotter without Ray around it: a scripted agent, a receive that fails."""
    from memsnap.rank.load import Loader
    from memsnap.rank.snapshotter import Snapshotter

    snap = object.__new__(Snapshotter)
    snap.rank, snap.config, snap.node = 0, SnapshotConfig("stub-job"), "n" * 56
    snap.client = cast("AgentClient", _Client(plans))  # the calls a restore makes, scripted
    snap.loader = Loader(snap.client, None, snap.config, 1, b"", direct=True)  # type: ignore[arg-type]  # no arena maps: nothing here maps one
    snap.loader._peers = object()  # type: ignore[assignment]  # a stand-in the failing receive never reads
    snap.capture = type("Capture", (), {"nbytes": lambda self, state: 0})()
    snap._policy = type("P", (), {"resume": lambda self, s: None})()
    snap._guard = None

    def failing(peers, source, manifest, state):
        raise fail_with

    monkeypatch.setattr(receive, "into_state", failing)
    return snap


PEER = {
    "step": 3,
    "tier": "peer",
    "plan": "ram",
    "source": RankSource(3, K, M, OWNER, 64, Region(0, 64, 0), ("h0", "h1", "h2"), (None,) * 3).to_wire(),
}
NONE = {"step": None, "tier": "none", "plan": "none"}


def test_a_restore_that_failed_mid_write_never_starts_fresh_on_mixed_state(monkeypatch):
    from memsnap.errors import MemsnapError, TooFewShardsError

    snap = _snapshotter([PEER, NONE], TooFewShardsError("stripe 4: only 1 of k=2 shards"), monkeypatch)
    with pytest.raises(MemsnapError, match="the live state was partly written"):
        snap.restore({})
    assert snap.client.done == [False, True]


def test_a_refused_restore_touched_nothing_and_may_start_fresh(monkeypatch):
    snap = _snapshotter([PEER, NONE], StateMismatchError("'model/w': snapshot has float32[4]"), monkeypatch)
    assert snap.restore({}) is None and not snap.loader.dirty
    assert snap.last_restore.tier == "none"


def test_a_state_written_outside_a_restore_is_never_handed_back_for_a_fresh_start(monkeypatch):
    """An in-place takeover refused halfway wrote into the live tensors: a restore that then
    finds nothing to load raises, as one whose own read failed midway does."""
    from memsnap.errors import MemsnapError

    snap = _snapshotter([NONE], AssertionError("nothing is received"), monkeypatch)
    snap.state_written()
    with pytest.raises(MemsnapError, match="the live state was partly written"):
        snap.restore({})
    fresh = _snapshotter([NONE], AssertionError("nothing is received"), monkeypatch)
    assert fresh.restore({}) is None  # the same plan on an untouched state: a fresh start


def test_a_rank_that_moved_reads_its_whole_copy_from_its_old_node_with_no_decode(holders):
    (source, manifest), want = publish(holders, make_state(12), step=8)
    stores, addrs, client = holders
    old_node = HeldChunks(MemoryBudget(1 << 30, "old"))  # serves the data shards, as its agent does
    for j in range(K):
        for key in stores[j].keys(8):
            old_node.put(key, stores[j].lookup(key)[0])
    server = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    try:
        copy = server.start(old_node)
        dead = {"transport": "tcp", "host": "127.0.0.1", "port": 1}  # both data holders are gone
        src = dataclasses.replace(source, addrs=(dead, dead, *source.addrs[K:]), copy=copy)
        live = make_state(13)
        stats = receive.into_state(peers(holders), src, manifest, live)
    finally:
        server.close()
    assert digest(live, rng=False) == want
    assert stats["decoded_stripes"] == 0  # every data shard came from the copy: nothing rebuilt
