"""A restore from peers inside the rank (receive.py), without Ray: real TCP holders, a real
codec, and a live model + optimizer that must end bitwise equal, received in place."""

from __future__ import annotations

import dataclasses
import os
import threading
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
    from memsnap.rank.maps import ArenaMaps

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
    snap._ahead, snap._ahead_lock, snap._restores = None, threading.Lock(), 0

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
    with pytest.raises(MemsnapError, match="begun writing into the live state"):
        snap.restore({})
    assert snap.client.done == [False, True]


def test_a_refused_restore_touched_nothing_and_may_start_fresh(monkeypatch):
    snap = _snapshotter([PEER, NONE], StateMismatchError("'model/w': snapshot has float32[4]"), monkeypatch)
    assert snap.restore({}) is None and not snap.loader.dirty
    assert snap.last_restore.tier == "none"


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


class _AheadClient:
    """What a read ahead of the plan asks the node's agent: the newest committed source and
    its manifest."""

    rank = 0

    def __init__(self, source: RankSource | None, manifest: str):
        self.source, self.manifest_json = source, manifest
        self.manifests = 0

    def newest_source(self) -> RankSource | None:
        return self.source

    def manifest(self, step, rank, source) -> str:
        self.manifests += 1
        return self.manifest_json


def _fresh_peers() -> receive.Peers:
    return receive.Peers(make_transport("tcp", secret=SECRET, host="127.0.0.1"), codec_for(K, M))


def _loader():
    from memsnap.rank.load import Loader

    client = cast("AgentClient", _AheadClient(None, ""))
    loader = Loader(client, cast("ArenaMaps", None), SnapshotConfig("stub-job"), 1, SECRET, direct=True)  # no maps
    loader.new_peers = _fresh_peers  # (bound to loopback, not Ray's node address)
    return loader


def _ahead(source: RankSource | None, manifest: str, max_bytes: int = 1 << 30):
    from memsnap.rank.prefetch import Prefetch

    return Prefetch(cast("AgentClient", _AheadClient(source, manifest)), _fresh_peers, max_bytes)


def _plan(source: RankSource, tier: str = "peer", step: int | None = None) -> RankPlan:
    return RankPlan(source.step if step is None else step, tier, "ram", None, source)


def test_bytes_read_ahead_of_the_plan_are_checked_and_applied_without_reading_them_again(holders, monkeypatch):
    (source, manifest), want = publish(holders, make_state(21), step=9)
    dead = {"transport": "tcp", "host": "127.0.0.1", "port": 1}  # a doubted holder: read from parity
    ahead = _ahead(dataclasses.replace(source, addrs=(dead, *source.addrs[1:])), manifest)
    loader, live, seconds = _loader(), make_state(22), {}

    def no_second_read(*a):
        raise AssertionError("the plan's bytes were read again")

    monkeypatch.setattr(receive, "into_state", no_second_read)
    assert loader.load(_plan(source), live, seconds, ahead) == "peer"
    assert digest(live, rng=False) == want
    assert seconds["prefetch"] > 0 and seconds["apply"] > 0 and loader.repaired == 0


def test_a_plan_of_another_step_or_tier_reads_as_usual_and_the_bytes_read_ahead_are_dropped(holders):
    (source, manifest), _ = publish(holders, make_state(23), step=10)
    (newer, newer_manifest), want = publish(holders, make_state(24), step=11)
    ahead = _ahead(source, manifest)  # step 10 read ahead; the plan loads step 11
    live, seconds = make_state(25), {}
    loader = _loader()
    loader.client = cast("AgentClient", _AheadClient(None, newer_manifest))  # (the plan's manifest)
    assert loader.load(_plan(newer), live, seconds, ahead) == "peer"
    assert digest(live, rng=False) == want and "prefetch" in seconds  # waited for, then not used
    (src12, man12), _ = publish(holders, make_state(26), step=12)
    skipped = _ahead(src12, man12)
    assert loader.load(RankPlan(None, "none", "none", None, None), make_state(27), {}, skipped) == "none"


def test_bytes_read_ahead_that_do_not_check_are_read_again_and_nothing_was_written_first(holders):
    (source, manifest), want = publish(holders, make_state(28), step=13)
    ahead = _ahead(source, manifest)
    staged = ahead.result(60)
    assert staged is not None and staged.serves(_plan(source)) and not staged.serves(_plan(source, step=12))
    staged.buf[len(staged.buf) // 2] ^= 0xFF  # damaged after it was read: its checksum no longer holds
    ahead._staged = staged
    loader, live, seconds = _loader(), make_state(29), {}
    loader.client = cast("AgentClient", _AheadClient(None, manifest))
    assert loader.load(_plan(source), live, seconds, ahead) == "peer"  # read again from the holders
    assert digest(live, rng=False) == want and not loader.dirty


def test_nothing_is_read_ahead_past_its_size_limit_or_without_a_committed_step(holders):
    (source, manifest), _ = publish(holders, make_state(30), step=14)
    big = _ahead(source, manifest, max_bytes=source.nbytes - 1)
    assert big.result(60) is None and "over prefetch_max_gib" in (big.skipped or "")
    none = _ahead(None, "")
    assert none.result(60) is None and "no committed step" in (none.skipped or "")


def test_a_read_ahead_serves_the_first_restore_alone_and_is_off_at_zero_gib(monkeypatch):
    snap = _snapshotter([NONE, NONE], StateMismatchError("unused"), monkeypatch)
    monkeypatch.setenv("MEMSNAP_PREFETCH_MAX_GIB", "0")
    assert snap.prefetch() is False and snap._ahead is None  # turned off
    monkeypatch.delenv("MEMSNAP_PREFETCH_MAX_GIB")
    assert snap.prefetch() is True and snap.prefetch() is False  # one read at a time
    assert snap.restore({}) is None and snap._ahead is None  # the restore took it (its plan: none)
    assert snap.prefetch() is False  # a read begun after a restore would serve nothing
