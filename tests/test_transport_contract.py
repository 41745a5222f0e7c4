"""One contract for every transport: TCP and Ray's object store behave the same."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from memsnap.errors import MemoryBudgetError, PushCancelled, StepGivenUp, TransportError
from memsnap.transport import ChunkKey, make_transport
from memsnap.transport.base import Scatter

SECRET = os.urandom(32)
SIZES = [0, 1, 63, 64, 65, 1000, 4097, (1 << 20) + 3, 3 << 20]


class DictStore:
    """An in-memory ChunkStore; refuses any chunk whose owner is "no-room", and any of a step
    given up (owner "given-up")."""

    def __init__(self):
        self.held, self.reserved, self.lock = {}, {}, threading.Lock()

    def reserve(self, key, nbytes):
        if key.owner == "no-room":
            raise MemoryBudgetError(f"no room for {nbytes} bytes of {key}")
        if key.owner == "given-up":
            raise StepGivenUp(f"chunk {key} is for step {key.step}, which the job gave up")
        buf = bytearray(nbytes)
        with self.lock:
            self.reserved[key] = buf
        return memoryview(buf)

    def complete(self, key, checksum):
        with self.lock:
            self.held[key] = (self.reserved.pop(key), checksum)

    def discard(self, key):
        with self.lock:
            self.reserved.pop(key, None)

    def lookup(self, key):
        with self.lock:
            entry = self.held.get(key)
        return None if entry is None else (memoryview(entry[0]), entry[1])

    def corrupt(self, key):
        self.held[key][0][0] ^= 0xFF


# --- the TCP side --------------------------------------------------------------------------
class TcpHarness:
    def __init__(self, wire: str = "mac"):
        self.wire = wire
        self.store = DictStore()
        self.server = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire=wire)
        self.addr = self.server.start(self.store)
        self.silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept_forever, daemon=True).start()
        self.hang_addr = {"transport": "tcp", "host": "127.0.0.1", "port": self.silent.getsockname()[1]}
        gone = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire=wire)
        self.gone_addr = gone.start(DictStore())
        gone.close()

    def _accept_forever(self):
        while True:
            try:
                self.accepted.append(self.silent.accept()[0])
            except OSError:
                return

    def client(self, small: bool = False):
        return make_transport(
            "tcp", secret=SECRET, host="127.0.0.1", wire=self.wire, **({"window": 2} if small else {})
        )

    def corrupt(self, key):
        self.store.corrupt(key)

    def held(self):
        return set(self.store.held)

    def close(self):
        self.server.close()
        self.silent.close()
        for s in self.accepted:
            s.close()


# --- the object-store side -----------------------------------------------------------------
def _holder_class():
    import sys

    import ray
    from ray import cloudpickle

    # workers cannot import this test module: ship the actor class and DictStore by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Holder:
        def __init__(self, hang: bool = False):
            from memsnap.transport.objstore import ObjStoreTransport

            self.hang = hang
            self.store = DictStore()
            self.transport = ObjStoreTransport()
            self.addr = self.transport.start(self.store)

        def address(self):
            return self.addr

        def objstore_push(self, packed_keys, data, lengths, checksums):
            if self.hang:
                threading.Event().wait(600)
            return self.transport.handle_push(packed_keys, data, lengths, checksums)

        def objstore_fetch(self, packed_keys):
            if self.hang:
                threading.Event().wait(600)
            return self.transport.handle_fetch(packed_keys)

        def corrupt(self, packed):
            self.store.corrupt(ChunkKey.unpack(packed))

        def held(self):
            return [k.pack() for k in self.store.held]

    return Holder


class ObjStoreHarness:
    def __init__(self, cluster):
        import ray

        holder = _holder_class()
        pin = {"memsnap_node_1": 0.01}  # the holder on the other node, so bytes cross nodes
        self.actor = holder.options(name="contract-holder", resources=pin).remote()
        self.addr = ray.get(self.actor.address.remote(), timeout=60)
        self.hanger = holder.options(name="contract-hanger", resources=pin).remote(hang=True)
        self.hang_addr = ray.get(self.hanger.address.remote(), timeout=60)
        gone = holder.options(name="contract-gone", resources=pin).remote()
        self.gone_addr = ray.get(gone.address.remote(), timeout=60)
        ray.kill(gone)

    def client(self, small: bool = False):
        return make_transport(
            "objstore", secret=SECRET, host="127.0.0.1", **({"batch_bytes": 64 << 10} if small else {})
        )

    def corrupt(self, key):
        import ray

        ray.get(self.actor.corrupt.remote(key.pack()), timeout=30)

    def held(self):
        import ray

        return {ChunkKey.unpack(k) for k in ray.get(self.actor.held.remote(), timeout=30)}

    def close(self):
        import ray

        for a in (self.actor, self.hanger):
            ray.kill(a)


@pytest.fixture(scope="module")
def cluster():
    from memsnap.localcluster import LocalCluster

    with LocalCluster(2, object_store_mb=128) as c:
        yield c


@pytest.fixture(scope="module", params=["tcp", "tcp-encrypt", pytest.param("objstore", marks=pytest.mark.ray)])
def harness(request):
    if request.param == "objstore":
        h = ObjStoreHarness(request.getfixturevalue("cluster"))
    else:
        h = TcpHarness("encrypt" if request.param == "tcp-encrypt" else "mac")
    try:
        yield h
    finally:
        h.close()


def _chunks(owner: str, step: int = 1, sizes=SIZES):
    return [(ChunkKey(step, owner, i, i % 3), memoryview(os.urandom(n))) for i, n in enumerate(sizes)]


def _empty_like(items):
    return [(k, memoryview(bytearray(len(v)))) for k, v in items]


def test_push_then_fetch_round_trips_every_size(harness):
    items = _chunks("round-trip")
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=60)
        assert {k for k, _ in items} <= harness.held()
        out = _empty_like(items)
        assert client.fetch(harness.addr, out, timeout=60) == [True] * len(items)
        assert [bytes(v) for _, v in out] == [bytes(v) for _, v in items]
    finally:
        client.close()


def test_many_small_chunks_in_one_call(harness):
    items = [(ChunkKey(2, "many", i, 0), memoryview(os.urandom(100 + i))) for i in range(300)]
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=60)
        out = _empty_like(items)
        assert all(client.fetch(harness.addr, out, timeout=60))
        assert all(bytes(a) == bytes(b) for (_, a), (_, b) in zip(items, out))
    finally:
        client.close()


def test_round_trip_with_little_in_flight(harness):
    """Many windows (TCP) or many batches (object store) per call, pipelined."""
    items = _chunks("small-window", sizes=SIZES + [50_000] * 12)
    client = harness.client(small=True)
    try:
        client.push(harness.addr, items, timeout=60)
        out = _empty_like(items)
        assert client.fetch(harness.addr, out, timeout=60) == [True] * len(items)
        assert [bytes(v) for _, v in out] == [bytes(v) for _, v in items]
    finally:
        client.close()


def _scattered(n: int, cuts: list[int]) -> Scatter:
    """``n`` bytes cut at ``cuts`` into separate buffers (a zero-length piece included)."""
    edges = [0, *sorted(c for c in cuts if 0 <= c <= n), n]
    return Scatter([bytearray(b - a) for a, b in zip(edges, edges[1:])])


def test_fetch_into_a_scatter_fills_the_pieces_in_order(harness):
    """A restoring rank fetches a shard straight into the tensors it spans."""
    items = _chunks("scatter", sizes=[1000, (1 << 20) + 3, 600 * 64])
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=60)
        dests = [
            _scattered(1000, [0, 1, 999]),
            _scattered((1 << 20) + 3, [4096, 4096, 700_001]),
            _scattered(600 * 64, list(range(0, 600 * 64, 64))),
        ]  # more pieces than one scatter read
        out = [(k, d) for (k, _), d in zip(items, dests)]
        assert client.fetch(harness.addr, out, timeout=60) == [True] * 3
        assert [d.joined() for d in dests] == [bytes(v) for _, v in items]
        harness.corrupt(items[1][0])
        again = _scattered((1 << 20) + 3, [10])
        assert client.fetch(harness.addr, [(items[1][0], again)], timeout=60) == [False]
        assert client.fetch(harness.addr, [(items[0][0], _scattered(999, [5]))], timeout=60) == [False]
    finally:
        client.close()


def test_missing_chunk_is_false_not_an_error(harness):
    items = _chunks("partly-there", sizes=[10, 20])
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=30)
        ask = [items[0], (ChunkKey(1, "partly-there", 99, 0), memoryview(b"x" * 5)), items[1]]
        assert client.fetch(harness.addr, _empty_like(ask), timeout=30) == [True, False, True]
        assert client.fetch(harness.addr, [], timeout=30) == []
    finally:
        client.close()


def test_wrong_length_buffer_is_false(harness):
    items = _chunks("sized", sizes=[100])
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=30)
        assert client.fetch(harness.addr, [(items[0][0], memoryview(bytearray(99)))], timeout=30) == [False]
    finally:
        client.close()


def test_corrupted_held_bytes_are_false_and_logged(harness, caplog):
    items = _chunks("corrupt", sizes=[4096, 4096, 1 << 20, 1 << 20])  # small and large chunks
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=30)
        harness.corrupt(items[0][0])
        harness.corrupt(items[3][0])
        out = _empty_like(items)
        with caplog.at_level(logging.WARNING, logger="memsnap.transport"):
            assert client.fetch(harness.addr, out, timeout=30) == [False, True, True, False]
        assert any("checksum" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    finally:
        client.close()


def test_concurrent_pushes_from_two_clients(harness):
    batches = {name: _chunks(name, sizes=[70_000 + i for i in range(24)]) for name in ("alpha", "beta")}
    errors = []

    def send(items):
        client = harness.client()
        try:
            client.push(harness.addr, items, timeout=60)
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=send, args=(b,)) for b in batches.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    client = harness.client()
    try:
        for items in batches.values():
            out = _empty_like(items)
            assert all(client.fetch(harness.addr, out, timeout=60))
            assert all(bytes(a) == bytes(b) for (_, a), (_, b) in zip(items, out))
    finally:
        client.close()


def test_refused_chunk_raises_naming_the_key(harness):
    items = _chunks("no-room", sizes=[10])
    client = harness.client()
    try:
        with pytest.raises(TransportError, match=r"no-room.*MemoryBudgetError|MemoryBudgetError.*no-room"):
            client.push(harness.addr, items, timeout=30)
        assert items[0][0] not in harness.held()
    finally:
        client.close()


def test_a_chunk_of_a_step_given_up_is_refused_as_such_not_as_a_failure(harness):
    """The sender tells a push in vain (the job gave the step up) from a failed one."""
    client = harness.client()
    try:
        with pytest.raises(StepGivenUp, match="given-up.*gave up"):
            client.push(harness.addr, _chunks("given-up", sizes=[10, 10]), timeout=30)
        with pytest.raises(TransportError) as failed:
            client.push(harness.addr, _chunks("no-room", sizes=[10]), timeout=30)
        assert not isinstance(failed.value, StepGivenUp)
    finally:
        client.close()


def test_a_push_called_off_stops_before_its_next_chunk_and_the_client_pushes_again(harness):
    """The sender's ``cancel`` (its step given up, or another holder's push failed) is asked
    before each chunk (each batch, object store): the rest is never sent, and the stream left
    with acknowledgements unread is not reused."""
    items = [(ChunkKey(3, "called-off", i, 0), memoryview(os.urandom(50_000))) for i in range(12)]
    asked = []

    def cancel() -> bool:
        asked.append(1)
        return len(asked) > 3

    client = harness.client(small=True)
    try:
        with pytest.raises(PushCancelled, match="called off at chunk"):
            client.push(harness.addr, items, timeout=30, cancel=cancel)
        assert not {k for k, _ in items[6:]} & harness.held(), "chunks after the call-off were sent"
        again = _chunks("after-a-call-off", sizes=[10, 50_000])
        client.push(harness.addr, again, timeout=30, cancel=lambda: False)
        assert {k for k, _ in again} <= harness.held()
    finally:
        client.close()


def test_peer_that_never_answers_times_out(harness):
    client = harness.client()
    try:
        with pytest.raises(TransportError, match="timed out") as info:
            client.push(harness.hang_addr, _chunks("hang", sizes=[10]), timeout=1.5)
        assert "hang" in str(info.value)
        with pytest.raises(TransportError, match="timed out"):
            client.fetch(harness.hang_addr, _empty_like(_chunks("hang", sizes=[10])), timeout=1.5)
    finally:
        client.close()


def test_peer_gone_raises_transport_error(harness):
    items = _chunks("gone", sizes=[10])
    client = harness.client()
    try:
        with pytest.raises(TransportError, match="gone"):
            client.push(harness.gone_addr, items, timeout=10)
        with pytest.raises(TransportError):
            client.fetch(harness.gone_addr, _empty_like(items), timeout=10)
    finally:
        client.close()


def test_checksums_are_xxh3_integers(harness):
    items = _chunks("sum", sizes=[1234])
    client = harness.client()
    try:
        client.push(harness.addr, items, timeout=30)
    finally:
        client.close()
    if isinstance(harness, TcpHarness):
        view, checksum = harness.store.lookup(items[0][0])
        assert checksum == xxhash.xxh3_64_intdigest(bytes(items[0][1])) == xxhash.xxh3_64_intdigest(view)


def test_bad_addresses_and_names_are_refused():
    with pytest.raises(ValueError, match="'carrier-pigeon'"):
        make_transport("carrier-pigeon", secret=SECRET, host="127.0.0.1")
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    with pytest.raises(ValueError, match="not a TCP address"):
        client.push({"actor": "x"}, _chunks("x", sizes=[1]), timeout=1)
    with pytest.raises(ValueError, match="at least 16 random bytes"):
        make_transport("tcp", secret=b"short", host="127.0.0.1")


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(0, (1 << 64) - 1),
    owner=st.text(min_size=1, max_size=80),
    stripe=st.integers(0, (1 << 32) - 1),
    shard=st.integers(0, (1 << 16) - 1),
)
def test_chunk_key_packs_and_unpacks_exactly(step, owner, stripe, shard):
    key = ChunkKey(step, owner, stripe, shard)
    assert ChunkKey.unpack(key.pack()) == key


def test_chunk_key_refuses_bad_values_and_bytes():
    with pytest.raises(ValueError, match="owner=''"):
        ChunkKey(1, "", 0, 0)
    with pytest.raises(ValueError, match="shard=70000"):
        ChunkKey(1, "n", 0, 70000)
    with pytest.raises(ValueError, match="at least"):
        ChunkKey.unpack(b"\x01\x02")
    with pytest.raises(ValueError, match="owner is 1 bytes but 0 follow"):
        ChunkKey.unpack(ChunkKey(1, "n", 0, 0).pack()[:-1])
    assert sorted([ChunkKey(2, "a", 0, 0), ChunkKey(1, "b", 5, 1)])[0].step == 1
