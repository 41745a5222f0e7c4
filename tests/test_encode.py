"""Striping a node's regions, parity, and rebuilding lost data shards."""

from __future__ import annotations

import numpy as np
import pytest

from memsnap.coding.encode import Encoded, ParityBatch, batches, reconstruct_data, regions, write_stripe


class XorCodec:
    """m=1 parity by XOR: a stand-in used only here, so the layout is tested apart from the codec."""

    def encode_into(self, data, parity):
        acc = np.zeros(len(parity[0]), np.uint8)
        for d in data:
            acc ^= np.frombuffer(d, np.uint8)
        np.frombuffer(parity[0], np.uint8)[:] = acc

    def reconstruct_data(self, shards):
        lost = [i for i, s in enumerate(shards) if s is None]
        assert len(lost) == 1
        acc = np.zeros(len(next(s for s in shards if s is not None)), np.uint8)
        for s in shards:
            if s is not None:
                acc ^= np.frombuffer(s, np.uint8)
        out = list(shards)
        out[lost[0]] = acc.tobytes()
        return out[:-1]


def test_regions_start_on_stripe_boundaries():
    regs = regions({3: 1000, 1: 64 * 10}, k=2, chunk=192)
    assert [(r.rank, r.stripe_base, r.stripes) for r in regs] == [(1, 0, 2), (3, 2, 3)]


@pytest.mark.parametrize("nbytes", [1, 383, 384, 1000, 4097])
@pytest.mark.parametrize("lost", [0, 1, 2])
@pytest.mark.parametrize("per_batch", [1, 2, 100])
def test_encode_in_batches_then_rebuild_any_single_lost_shard(nbytes, lost, per_batch):
    k, m, chunk = 2, 1, 192
    region = regions({0: nbytes}, k, chunk)[0]
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    enc = Encoded(region, memoryview(src))
    parity = {}
    scratch = memoryview(bytearray(per_batch * m * chunk))  # reused by every batch
    for members in batches([enc], per_batch):
        assert 1 <= len(members) <= per_batch
        batch = ParityBatch(members, m, chunk, scratch)
        batch.encode(XorCodec())
        for key, view in batch.items(0, "n", k):
            parity[key.stripe] = bytes(view)
    assert sorted(parity) == list(range(region.stripes))
    out = bytearray(nbytes)
    for s in range(region.stripes):
        shards = [bytes(enc.shard(s, j)) for j in range(k)] + [parity[s]]
        assert all(len(x) == chunk for x in shards)
        shards[lost] = None
        write_stripe(memoryview(out), region.layout, s, reconstruct_data(XorCodec(), shards, k))
    assert bytes(out) == src.tobytes()


def test_items_are_keyed_from_the_stripe_base():
    regs = regions({0: 100, 1: 1000}, k=1, chunk=256)
    encs = [Encoded(r, memoryview(bytearray(r.nbytes))) for r in regs]
    keys = [key for key, _ in encs[1].items(5, "nodeA", 0)]
    assert [k.stripe for k in keys] == [1, 2, 3, 4] and {k.shard for k in keys} == {0}
    runs = batches(encs, 3)
    assert [[(e.region.rank, s) for e, s in run] for run in runs] == [[(0, 0), (1, 0), (1, 1)], [(1, 2), (1, 3)]]
    batch = ParityBatch(runs[1], 1, 256, memoryview(bytearray(2 * 256)))
    assert [(k.stripe, k.shard) for k, _ in batch.items(5, "nodeA", 1)] == [(3, 1), (4, 1)]


def test_a_parity_batch_refuses_a_short_buffer_and_a_region_has_no_parity_shard():
    region = regions({0: 1000}, k=2, chunk=192)[0]
    enc = Encoded(region, memoryview(bytearray(1000)))
    with pytest.raises(ValueError, match="needed"):
        ParityBatch(batches([enc], 2)[0], 1, 192, memoryview(bytearray(191)))
    with pytest.raises(IndexError, match="ParityBatch"):
        enc.shard(0, 2)
