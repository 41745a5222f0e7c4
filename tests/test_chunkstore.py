"""HeldChunks: the ChunkStore an agent serves its peers from."""
from __future__ import annotations

import pytest
import xxhash

from memsnap.arena import MemoryBudget
from memsnap.chunkstore import HeldChunks
from memsnap.errors import MemoryBudgetError
from memsnap.transport.base import ChunkKey


def key(step=1, stripe=0, shard=0, owner="n1"):
    return ChunkKey(step, owner, stripe, shard)


def test_reserve_complete_lookup_round_trip():
    store = HeldChunks(MemoryBudget(1 << 20))
    dst = store.reserve(key(), 128)
    dst[:] = bytes(range(128))
    assert store.lookup(key()) is None  # not complete yet
    store.complete(key(), 7)
    mv, c = store.lookup(key())
    assert bytes(mv[:128]) == bytes(range(128)) and c == 7


def test_discard_and_drop_reuse_buffers_without_new_charges():
    budget = MemoryBudget(1 << 20)
    store = HeldChunks(budget)
    store.reserve(key(stripe=0), 4096)
    store.discard(key(stripe=0))
    store.put(key(stripe=1), b"x" * 4096)
    used = budget.used
    assert store.drop(lambda k: k.step != 1) == 1
    store.put(key(step=2), b"y" * 4096)
    assert budget.used == used  # the freed buffer was reused
    assert store.lookup(key(stripe=1)) is None
    assert store.lookup(key(step=2))[1] == xxhash.xxh3_64_intdigest(b"y" * 4096)


def test_inventory_and_budget_refusal():
    store = HeldChunks(MemoryBudget(3 * 4096))
    for s in range(3):
        store.put(key(stripe=s, shard=1), b"z" * 4096)
    assert store.inventory() == {1: {"n1": {1: 3}}}
    with pytest.raises(MemoryBudgetError, match="memory_budget"):
        store.reserve(key(stripe=9), 4096)


def test_flip_byte_changes_the_bytes_not_the_checksum():
    store = HeldChunks(MemoryBudget(1 << 20))
    store.put(key(), b"\0" * 64)
    store.flip_byte(key(), 3)
    mv, c = store.lookup(key())
    assert mv[3] == 0xFF and c == xxhash.xxh3_64_intdigest(b"\0" * 64)
