"""Striping a node's regions, parity, and rebuilding lost data shards."""
from __future__ import annotations

import numpy as np
import pytest

from memsnap.encode import Encoded, reconstruct_data, regions, write_stripe


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
def test_encode_then_rebuild_any_single_lost_shard(nbytes, lost):
    k, m, chunk = 2, 1, 192
    region = regions({0: nbytes}, k, chunk)[0]
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    parity = bytearray(region.stripes * m * chunk)
    enc = Encoded(region, memoryview(src), memoryview(parity), m)
    enc.encode(XorCodec())
    out = bytearray(nbytes)
    for s in range(region.stripes):
        shards = [bytes(enc.shard(s, j)) for j in range(k + m)]
        assert all(len(x) == chunk for x in shards)
        shards[lost] = None
        write_stripe(memoryview(out), region.layout, s, reconstruct_data(XorCodec(), shards, k))
    assert bytes(out) == src.tobytes()


def test_items_are_keyed_from_the_stripe_base():
    region = regions({0: 100, 1: 1000}, k=1, chunk=256)[1]
    enc = Encoded(region, memoryview(bytearray(1000)), memoryview(bytearray(region.stripes * 256)), 1)
    keys = [key for key, _ in enc.items(5, "nodeA", 1)]
    assert [k.stripe for k in keys] == [1, 2, 3, 4] and {k.shard for k in keys} == {1}
