"""Elastic restore from RAM without Ray: which saved regions each new rank reads, the
collective plan for a job back with another world size (several ranks per node), and the
partial read from real TCP holders, resharded bitwise (with a holder gone: decoded)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from support.holders import tcp_holders

from memsnap.coding import elastic, encode, receive
from memsnap.coding.codec import codec_for
from memsnap.coding.stripes import choose_chunk, stripes_of
from memsnap.config import SnapshotConfig
from memsnap.errors import ChecksumError
from memsnap.job import coverage
from memsnap.job.coordinator import CoordinatorCore
from memsnap.records import CommitRecord, Inventory, NodeReady, RankPlan, RankRestore, RankSource, Region
from memsnap.state.capture import capture, plan
from memsnap.state.manifest import Manifest

ROWS, COLS, WIDE = 14, 6, 40  # w: (14, 6) Shard(0); b: (6,) replicated; e: (14, 40) Shard(0), the bulk
K, M = 2, 1
SECRET = os.urandom(32)
FULL_W = torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)
FULL_E = torch.randn(ROWS, WIDE, generator=torch.Generator().manual_seed(3))
BIAS = torch.linspace(-1, 1, COLS)


def rows(rank: int, world: int) -> tuple[int, int]:
    """DTensor's Shard(0) split: ceil-sized chunks, the last ones short or empty."""
    per = -(-ROWS // world)
    a = min(rank * per, ROWS)
    return a, min(a + per, ROWS)


def shard_state(rank: int, world: int, fill: bool = True) -> tuple[dict, Manifest]:
    """Rank ``rank`` of ``world``'s state and its layout with the DTensor metadata a capture
    of real DTensors records (global shape, this shard's offset, placements)."""
    a, b = rows(rank, world)
    mod = torch.nn.Module()
    w = FULL_W[a:b].clone() if fill else torch.zeros(b - a, COLS)
    e = FULL_E[a:b].clone() if fill else torch.zeros(b - a, WIDE)
    mod.register_buffer("w", w)
    mod.register_buffer("e", e)
    mod.register_buffer("b", BIAS.clone() if fill else torch.zeros(COLS))
    mod.register_buffer("n", torch.full((3,), float(rank) if fill else -1.0))  # plain: from saved r % W
    state = {"model": mod}
    return state, _sharded(plan(state), rank, world)


def _sharded(man: Manifest, rank: int, world: int) -> Manifest:
    a, _ = rows(rank, world)
    out = []
    for e in man.tensors:
        name = e.path.rsplit("/", 1)[-1] if e.path.startswith("model/") else ""
        if name in ("w", "e"):
            e = dataclasses.replace(
                e,
                global_shape=(ROWS, COLS if name == "w" else WIDE),
                global_offset=(a, 0),
                placements=("Shard(0)",),
                mesh_shape=(world,),
            )
        elif name == "b":
            e = dataclasses.replace(
                e, global_shape=(COLS,), global_offset=(0,), placements=("Replicate()",), mesh_shape=(world,)
            )
        out.append(e)
    return dataclasses.replace(man, tensors=out, tensors_json=None)


def saved_step(world: int) -> tuple[list[Manifest], list[memoryview]]:
    mans, bufs = [], []
    for r in range(world):
        state, layout = shard_state(r, world)
        man, buf = capture(state, checksums=True, manifest=None)
        man = dataclasses.replace(_sharded(man, r, world), meta={"rank": r, "world_size": world})
        mans.append(man)
        bufs.append(buf)
    return mans, bufs


def path_of(man: Manifest, name: str) -> str:
    return next(e.path for e in man.tensors if e.path.endswith(name))


# --- which saved regions each new rank reads (pure) ---------------------------------------------
@pytest.mark.parametrize("old,new", [(4, 3), (3, 4), (4, 2), (2, 5)])
def test_each_new_rank_reads_exactly_the_saved_shards_its_rows_overlap(old, new):
    saved, _ = saved_step(old)
    w, b, n = (path_of(saved[0], x) for x in ("/w", "/b", "/n"))
    for r in range(new):
        _, live = shard_state(r, new, fill=False)
        target, reads = elastic.read_plan(saved, live, r)
        a, z = rows(r, new)
        want = {s for s in range(old) if rows(s, old)[0] < z and a < rows(s, old)[1]} if z > a else set()
        assert {s for s, paths in reads.items() if w in paths} == want
        assert [s for s, paths in reads.items() if b in paths] == [0]  # replicated: read once
        assert [s for s, paths in reads.items() if n in paths] == [r % old]  # plain: saved r % W
        assert target.entry(w).shape == (z - a, COLS) and target.entry(w).global_offset == (a, 0)


def test_the_stripes_read_cover_each_tensor_and_merge_into_ranges():
    saved, _ = saved_step(4)
    man = saved[1]
    e = man.entry(path_of(man, "/e"))
    chunk = 64
    stripes, ranges = elastic.stripe_span([e], 2, chunk, man.nbytes)
    per = 2 * chunk
    assert stripes == list(range(e.offset // per, (e.offset + e.nbytes - 1) // per + 1))
    assert ranges == [(stripes[0] * per, min((stripes[-1] + 1) * per, man.nbytes))]
    assert elastic.stripe_span([], 2, chunk, man.nbytes) == ([], [])


# --- the collective plan: several ranks per node ------------------------------------------------
NODES = ["a", "b", "c", "d"]


def committed(step: int, per_node: int, chunk: int = 4096, stripes: int = 3) -> CommitRecord:
    """A step taken by ``per_node`` ranks on each of nodes a-d (world 4 * per_node), each node's
    shards held by the three others."""
    infos, rank = {}, 0
    for node in NODES:
        regions = tuple(Region(rank + j, stripes * K * chunk, j * stripes) for j in range(per_node))
        holders = tuple(n for n in NODES if n != node)
        infos[node] = NodeReady(step, node, 0, chunk, regions, holders, world=4 * per_node)
        rank += per_node
    return CommitRecord(step, K, M, infos)


def inventories(record: CommitRecord, alive: list[str], drop: dict[str, str] | None = None) -> dict:
    """What the live agents report: their own ranks' committed copies and every chunk they hold,
    less ``drop`` (``{holder: owner}``: that holder lost every chunk of that owner)."""
    out = {}
    for node in alive:
        held = {}
        for owner, info in record.nodes.items():
            if node in info.holders and (drop or {}).get(node) != owner:
                held[owner] = {info.holders.index(node): stripes_of(info.regions, K, info.chunk)}
        out[node] = Inventory(
            node, {"port": 1}, {record.step: ("committed", tuple(record.ranks_of(node)))}, {record.step: held}
        )
    return out


def test_a_job_back_on_fewer_nodes_with_several_ranks_each_reads_every_saved_rank_from_ram():
    record = committed(7, per_node=2)  # 8 ranks on 4 nodes; node d is lost; 6 ranks on a-c now
    members = {r: NODES[r // 2] for r in range(6)}
    got = coverage.decide({7: record}, members, inventories(record, ["a", "b", "c"]), durable_step=5)
    assert got.step == 7 and got.plan == "ram" and set(got.ranks.values()) == {"elastic"}
    assert got.saved == {r: ("peer" if r >= 6 else "copy") for r in range(8)}  # d's ranks from its holders


def test_more_ranks_than_were_saved_read_from_ram_too():
    record = committed(7, per_node=1)
    members = {r: NODES[r % 4] for r in range(6)}  # 4 -> 6 ranks: two nodes run two now
    got = coverage.decide({7: record}, members, inventories(record, NODES), durable_step=None)
    assert got.plan == "ram" and got.saved == {r: "copy" for r in range(4)}


def test_when_a_saved_rank_cannot_be_read_every_rank_loads_the_durable_step():
    record = committed(7, per_node=2)
    members = {r: NODES[r // 3] for r in range(6)}  # 6 ranks on a, b
    inv = inventories(record, ["a", "b"], drop={"b": "d"})  # d is gone and b lost its chunks of d
    got = coverage.decide({7: record}, members, inv, durable_step=5)
    assert got == coverage.JobPlan(5, "durable", {r: "durable" for r in range(6)})
    assert coverage.decide({7: record}, members, inv, durable_step=None).plan == "none"


def coordinator(per_node: dict[str, int], alive: set[str]) -> CoordinatorCore:
    core = CoordinatorCore(SnapshotConfig("unit-elastic").to_dict(), sum(per_node.values()))
    core.broadcast = lambda *args: None  # type: ignore[method-assign]  # a stand-in for the real method
    core.reprotect.kick = lambda: None  # type: ignore[method-assign]  # no agents here to rebuild on
    join(core, per_node, alive)
    return core


def join(core: CoordinatorCore, per_node: dict[str, int], alive: set[str], world: int | None = None) -> None:
    rank = 0
    for node, n in per_node.items():
        core.membership.alive = lambda: set(alive)
        core.membership.find_spares = lambda busy: {}
        core.join(node, {"port": ord(node)}, list(range(rank, rank + n)), world)
        rank += n


def test_the_coordinator_takes_the_new_world_size_plans_elastic_and_frees_the_old_step_on_the_next_commit():
    core = coordinator({n: 2 for n in NODES}, set(NODES))
    record = committed(7, per_node=2)
    for info in record.nodes.values():
        core.node_ready(info.to_wire())
    assert core.log.records[7].world == 8
    # node d is lost; the job comes back with 6 ranks, two on each of a, b, c
    join(core, {"a": 2, "b": 2, "c": 2}, {"a", "b", "c"}, world=6)
    assert core.world == 6 and sorted(core.membership.members) == list(range(6))
    assert core.answer("a").ranks == (0, 1) and core.answer("a").peers is False  # 3 nodes < k+m+1
    core.inventories = lambda **_: inventories(record, ["a", "b", "c"])
    core._durable_step = lambda: None
    core.restore_arrive(0, list(range(6)))
    assert core.rounds.all_arrived(0)
    plans = {r: RankPlan.from_wire(p) for r, p in core.plans_for("c", 0).items()}
    assert sorted(plans) == [4, 5]
    for p in plans.values():
        assert p.tier == "elastic" and p.step == 7 and [s.rank for s in p.sources] == list(range(8))
        assert [s.copy is not None for s in p.sources] == [True] * 6 + [False] * 2
        assert p.sources[6].owner == "d" and p.sources[6].addrs == (
            {"port": ord("a")},
            {"port": ord("b")},
            {"port": ord("c")},
        )
    core.restore_report(0, {r: RankRestore.loaded("elastic", {"total": 0.1}) for r in range(6)})
    assert core.restore_result(0).ok and core.last_restore.tier == "elastic" and core.last_restore.step == 7
    gen = core.log.gen
    for node, ranks in {"a": (0, 1), "b": (2, 3), "c": (4, 5)}.items():
        regions = tuple(Region(r, 1024, i) for i, r in enumerate(ranks))
        core.node_ready(NodeReady(8, node, gen, 4096, regions, (), world=6).to_wire())
    assert sorted(core.log.records) == [8]  # the new layout committed: the old world's step is let go


# --- the partial read from real holders ------------------------------------------------------------
@pytest.fixture(scope="module")
def holders():
    with tcp_holders(K + M, SECRET) as h:
        yield h


def publish(holders, mans: list[Manifest], bufs: list, step: int) -> list[RankSource]:
    """Every saved rank's bytes as its own owner's stream, pushed to the holders."""
    stores, addrs, client = holders
    codec, out = codec_for(K, M), []
    for r, (man, buf) in enumerate(zip(mans, bufs)):
        chunk = choose_chunk(man.nbytes, K, 256)
        region = encode.StripedRegion(r, man.nbytes, 0, K, chunk)
        enc = encode.Encoded(region, buf)
        parity = memoryview(bytearray(region.stripes * M * chunk))
        encode.ParityBatch([(enc, s) for s in range(region.stripes)], M, chunk, parity).encode(codec)
        for j in range(K + M):
            items = (
                enc.items(step, f"owner{r}", j)
                if j < K
                else encode.ParityBatch([(enc, s) for s in range(region.stripes)], M, chunk, parity).items(
                    step, f"owner{r}", j
                )
            )
            client.push(addrs[j], items, timeout=60)
        out.append(
            RankSource(
                step,
                K,
                M,
                f"owner{r}",
                chunk,
                Region(r, man.nbytes, 0),
                tuple(f"h{j}" for j in range(K + M)),
                tuple(addrs),
            )
        )
    return out


def peers(holders) -> receive.Peers:
    return receive.Peers(holders[2], codec_for(K, M))


def load(holders, sources, mans, rank: int, world: int) -> tuple[dict, dict]:
    from memsnap.state.apply import apply

    live, layout = shard_state(rank, world, fill=False)
    man, buf, stats = elastic.assemble(peers(holders), sources, [m.to_json() for m in mans], layout, rank)
    apply(live, man, buf, verify=False)
    return live, stats


@pytest.mark.parametrize("old,new", [(4, 3), (3, 4)])
def test_a_resharded_load_from_ram_is_bitwise_the_new_ranks_rows_and_reads_only_what_it_needs(holders, old, new):
    mans, bufs = saved_step(old)
    sources = publish(holders, mans, bufs, step=10 + old)
    for r in range(new):
        live, stats = load(holders, sources, mans, r, new)
        a, z = rows(r, new)
        mod = live["model"]
        assert torch.equal(mod.w, FULL_W[a:z]) and torch.equal(mod.e, FULL_E[a:z]) and torch.equal(mod.b, BIAS)
        assert torch.equal(mod.n, torch.full((3,), float(r % old)))
        assert stats["bytes"] < sum(m.nbytes for m in mans) / 2  # byte ranges, not every saved rank whole
        assert stats["decoded_stripes"] == 0


def test_a_lost_holder_is_decoded_and_a_damaged_chunk_is_refused(holders):
    mans, bufs = saved_step(4)
    sources = publish(holders, mans, bufs, step=20)
    dead = {"transport": "tcp", "host": "127.0.0.1", "port": 1}  # nobody listens there
    gone = [dataclasses.replace(s, addrs=(dead, *s.addrs[1:])) for s in sources]
    live, stats = load(holders, gone, mans, 1, 3)
    a, z = rows(1, 3)
    assert torch.equal(live["model"].e, FULL_E[a:z]) and stats["decoded_stripes"] > 0
    # every byte a saved rank's manifest records wrongly is caught before the state is touched
    bad = [
        dataclasses.replace(
            m,
            tensors=[dataclasses.replace(e, checksum="0" * 16) if e.path.endswith("/e") else e for e in m.tensors],
            tensors_json=None,
        )
        for m in mans
    ]
    with pytest.raises(ChecksumError, match=r"saved rank 0's tensor 'model/e' of step 20 hashes to"):
        load(holders, sources, bad, 0, 3)


def test_without_peers_every_saved_rank_is_read_from_its_old_nodes_copy(holders):
    """A job too small for peers (its old nodes hold each rank's only copy): no holders at all."""
    stores, addrs, client = holders
    mans, bufs = saved_step(3)
    sources = []
    for r, (man, buf) in enumerate(zip(mans, bufs)):
        chunk = choose_chunk(man.nbytes, K, 256)
        enc = encode.Encoded(encode.StripedRegion(r, man.nbytes, 0, K, chunk), buf)
        for j in range(K):  # the old node's whole copy, served from one place
            client.push(addrs[0], enc.items(30, f"alone{r}", j), timeout=60)
        sources.append(RankSource(30, K, M, f"alone{r}", chunk, Region(r, man.nbytes, 0), (), (), copy=addrs[0]))
    live, _ = load(holders, sources, mans, 3, 4)
    a, z = rows(3, 4)
    assert torch.equal(live["model"].w, FULL_W[a:z]) and torch.equal(live["model"].n, torch.full((3,), 0.0))


def test_a_replicated_tensor_is_read_from_a_surviving_copy_spread_over_the_new_ranks():
    saved, _ = saved_step(4)
    b = path_of(saved[0], "/b")
    src = [
        RankSource(1, K, M, f"n{r}", 64, Region(r, 1, 0), (), (), copy=None if r == 1 else {"port": r})
        for r in range(4)
    ]  # saved rank 1's node is gone: its bytes would be decoded from holders
    picked = []
    for r in range(3):
        _, live = shard_state(r, 3, fill=False)
        _, reads = elastic.read_plan(saved, live, r, elastic.replica_order(src, r))
        picked.append([s for s, paths in reads.items() if b in paths])
    assert picked == [[0], [2], [2]]  # never rank 1 (no copy left), each from the copy at or after its own number
