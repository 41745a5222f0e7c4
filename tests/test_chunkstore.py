"""HeldChunks: the ChunkStore an agent serves its peers from."""

from __future__ import annotations

import threading

import pytest
import xxhash

from memsnap.errors import MemoryBudgetError, StepGivenUp
from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import ChunkRefused, HeldChunks
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


def test_second_reservation_of_a_chunk_in_flight_is_refused_and_shares_nothing():
    budget = MemoryBudget(1 << 20)
    store = HeldChunks(budget)
    first = store.reserve(key(), 64)
    with pytest.raises(ChunkRefused, match="already being received"):
        store.reserve(key(), 64)
    first[:] = b"a" * 64
    store.complete(key(), 1)
    again = store.reserve(key(), 64)  # a chunk held (not in flight) may be pushed again
    assert bytes(store.lookup(key())[0][:64]) == b"a" * 64
    again[:] = b"b" * 64
    store.complete(key(), 2)
    assert bytes(store.lookup(key())[0][:64]) == b"b" * 64


def test_discarded_reservation_goes_back_to_the_budget():
    budget = MemoryBudget(1 << 20)
    store = HeldChunks(budget)
    store.reserve(key(), 4096)
    assert budget.used == 4096 and store.pending() == 1
    store.discard(key())
    assert budget.used == 0 and store.pending() == 0


def test_no_reader_sees_a_discarded_reservation_gone_and_its_bytes_still_charged():
    """A reader in another thread, started while the budget is being released, sees the
    reservation and its charge go together: ``pending()`` waits until both are gone."""
    seen, readers = [], []

    class Watched(MemoryBudget):
        def release(self, nbytes):
            reader = threading.Thread(target=lambda: seen.append((store.pending(), self.used)))
            readers.append(reader)
            reader.start()
            reader.join(timeout=0.5)  # the store holds its lock here, so the reader waits for it
            super().release(nbytes)

    store = HeldChunks(Watched(1 << 20))
    store.reserve(key(), 4096)
    store.discard(key())
    for reader in readers:
        reader.join(timeout=10)
    assert seen == [(0, 0)]  # not (0, 4096): gone from pending() but still charged


def test_far_future_steps_are_refused_until_announced():
    store = HeldChunks(MemoryBudget(1 << 20), step_window=10)
    store.put(key(step=100), b"x")
    store.put(key(step=110), b"x")  # within the window of the newest step known
    with pytest.raises(ChunkRefused, match="store_step_window=10"):
        store.reserve(key(step=121), 1)
    store.announce(120)
    store.put(key(step=121), b"x")
    assert [k.step for k in store.keys()] == [100, 110, 121]


def test_the_step_window_is_a_tunable(monkeypatch):
    monkeypatch.setenv("MEMSNAP_STORE_STEP_WINDOW", "3")
    store = HeldChunks(MemoryBudget(1 << 20))
    store.put(key(step=1), b"x")
    with pytest.raises(ChunkRefused):
        store.reserve(key(step=5), 1)


def test_a_step_given_up_is_freed_and_its_late_pushes_refused_until_the_job_resumes_below_it():
    """A sender still sending a step the job abandoned must not refill the budget with it:
    nothing would ever free those chunks (no commit of that step is coming)."""
    budget = MemoryBudget(1 << 20)
    store = HeldChunks(budget)
    store.put(key(step=5, stripe=0), b"a" * 4096)
    store.put(key(step=6, stripe=0), b"b" * 4096)
    assert store.give_up(5) == 1
    assert store.keys() == [key(step=6, stripe=0)]
    with pytest.raises(StepGivenUp, match="step 5, which the job gave up"):
        store.reserve(key(step=5, stripe=1), 4096)
    store.put(key(step=7), b"c" * 4096)  # other steps come in as before
    store.reopen(4)  # the job resumed from step 4: step 5 may be taken again
    store.put(key(step=5, stripe=1), b"d" * 4096)
    assert store.lookup(key(step=5, stripe=1))[1] == xxhash.xxh3_64_intdigest(b"d" * 4096)
