"""The codec's public API: buffer kinds, ownership, the generator's MDS property and its errors."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from support import gf_oracle as oracle

from memsnap.coding import codec
from memsnap.errors import CodecError, ShardSizeError, TooFewShardsError


def stripe(k: int, m: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    rs = codec.ReedSolomon(k, m)
    return rs, data, rs.encode(data)


# --- the generator ---------------------------------------------------------------------------
@pytest.mark.parametrize("k,m", [(1, 1), (1, 255), (255, 1), (4, 2), (254, 2), (6, 3), (128, 128), (10, 4)])
def test_generator_is_the_documented_matrix(k: int, m: int) -> None:
    want = np.array(oracle.generator(k, m), dtype=np.uint8).reshape(m, k)
    assert np.array_equal(codec.ReedSolomon(k, m).generator(), want)


@pytest.mark.parametrize("k,m", [(1, 3), (2, 2), (3, 3), (4, 2), (5, 3), (6, 3), (4, 4), (8, 2), (10, 4)])
def test_every_k_rows_of_the_full_generator_are_invertible(k: int, m: int) -> None:
    full = np.vstack([np.eye(k, dtype=np.uint8), codec.ReedSolomon(k, m).generator()]).tolist()
    for rows in itertools.combinations(range(k + m), k):
        assert oracle.rank([full[r] for r in rows]) == k, rows


def test_raid6_q_row_stays_mds_for_the_largest_k() -> None:
    q = codec.ReedSolomon(254, 2).generator()[1].tolist()
    assert len(set(q)) == 254 and 0 not in q  # every pair of lost data shards is solvable


def test_first_parity_is_xor_and_k1_is_replication() -> None:
    rs, data, parity = stripe(5, 3, 1001)
    assert parity[0].tobytes() == np.bitwise_xor.reduce(np.stack(data)).tobytes()
    rs1, data1, parity1 = stripe(1, 4, 333)
    assert all(p.tobytes() == data1[0].tobytes() for p in parity1)


# --- buffer kinds and ownership --------------------------------------------------------------
def test_every_buffer_kind_encodes_the_same() -> None:
    torch = pytest.importorskip("torch")
    rs, data, parity = stripe(3, 2, 4099)
    kinds = [
        [d.tobytes() for d in data],
        [memoryview(d) for d in data],
        [pa.py_buffer(d.tobytes()) for d in data],
        [torch.from_numpy(d.copy()).numpy() for d in data],
        [bytearray(d.tobytes()) for d in data],
    ]
    for shards in kinds:
        assert [p.tobytes() for p in rs.encode(shards)] == [p.tobytes() for p in parity]


def test_encode_into_writes_arena_slices_in_place() -> None:
    k, m, chunk, stagger = 4, 2, 4096 + 5, 3 * 64
    arena = np.zeros((k + m) * (chunk + stagger), dtype=np.uint8)
    view = memoryview(arena)  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    slots = [view[i * (chunk + stagger) : i * (chunk + stagger) + chunk] for i in range(k + m)]
    rng = np.random.default_rng(1)
    for s in slots[:k]:
        s[:] = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes()
    rs = codec.ReedSolomon(k, m)
    assert rs.encode_into(slots[:k], slots[k:]) is None  # type: ignore[func-returns-value]  # the test checks that it returns None
    want = rs.encode([np.frombuffer(s, np.uint8) for s in slots[:k]])
    assert [bytes(s) for s in slots[k:]] == [w.tobytes() for w in want]


def test_reconstruct_returns_present_shards_themselves() -> None:
    rs, data, parity = stripe(4, 2, 500)
    shards = [None, data[1], data[2], None, parity[0], parity[1]]
    out = rs.reconstruct(shards)
    assert all(out[i] is shards[i] for i in (1, 2, 4, 5))
    assert out[0].tobytes() == data[0].tobytes() and out[3].tobytes() == data[3].tobytes()
    assert shards[0] is None  # the caller's list is left alone


def test_reconstruct_data_leaves_lost_parity_alone() -> None:
    rs, data, parity = stripe(4, 3, 200)
    out = rs.reconstruct_data([data[0], None, data[2], data[3], None, parity[1], None])
    assert out[1].tobytes() == data[1].tobytes()
    assert out[4] is None and out[6] is None


def test_reconstruct_into_caller_buffers() -> None:
    rs, data, parity = stripe(4, 2, 300)
    target = bytearray(300)
    out = rs.reconstruct([data[0], None, data[2], data[3], parity[0], parity[1]], out={1: target})
    assert out[1] is target and bytes(target) == data[1].tobytes()


def test_nothing_lost_and_zero_length_and_m0() -> None:
    rs, data, parity = stripe(3, 2, 0)
    assert [p.size for p in parity] == [0, 0]
    assert rs.reconstruct([None, b"", b"", b"", None])[0].size == 0
    rs0 = codec.ReedSolomon(3, 0)
    assert rs0.encode([b"ab", b"cd", b"ef"]) == []
    assert rs0.reconstruct([b"ab", b"cd", b"ef"]) == [b"ab", b"cd", b"ef"]


def test_verify_detects_a_flipped_bit() -> None:
    rs, data, parity = stripe(4, 2, 777)
    full = data + parity
    assert rs.verify(full)
    bad = [s.copy() for s in full]
    bad[5][400] ^= 0x10
    assert not rs.verify(bad)


def test_threads_give_the_same_bytes() -> None:
    rng = np.random.default_rng(2)
    data = [rng.integers(0, 256, (3 << 20) + 13, dtype=np.uint8) for _ in range(4)]
    one = codec.ReedSolomon(4, 3).encode(data)
    many = codec.ReedSolomon(4, 3, threads=0).encode(data)
    assert all(np.array_equal(a, b) for a, b in zip(one, many))
    lost = [None, data[1], None, data[3], one[0], None, one[2]]
    out = codec.ReedSolomon(4, 3, threads=3).reconstruct(lost)
    assert np.array_equal(out[0], data[0]) and np.array_equal(out[5], one[1])


# --- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k,m", [(0, 1), (1, -1), (200, 57), ("4", 2), (True, 2), (4, 2.0)])
def test_bad_geometry(k, m) -> None:
    with pytest.raises(CodecError, match="k=|m="):
        codec.ReedSolomon(k, m)


def test_bad_threads() -> None:
    with pytest.raises(CodecError, match="threads=-1"):
        codec.ReedSolomon(2, 1, threads=-1)


def test_wrong_number_of_shards() -> None:
    rs = codec.ReedSolomon(4, 2)
    with pytest.raises(CodecError, match="expected 4 data shards, got 3"):
        rs.encode([b"a", b"b", b"c"])
    with pytest.raises(CodecError, match="expected 2 parity buffers, got 1"):
        rs.encode_into([b"a"] * 4, [bytearray(1)])
    with pytest.raises(CodecError, match="expected 6 shards"):
        rs.reconstruct([b"a"] * 5)
    with pytest.raises(CodecError, match="list of 4 data shards"):
        rs.encode(42)  # type: ignore[arg-type]  # a bad value on purpose


def test_mismatched_lengths_name_the_shard() -> None:
    rs = codec.ReedSolomon(4, 2)
    with pytest.raises(ShardSizeError, match=r"data shard 2 has 9 bytes, expected 8 like data shard 0"):
        rs.encode([b"x" * 8, b"x" * 8, b"x" * 9, b"x" * 8])
    with pytest.raises(ShardSizeError, match=r"parity shard 5 has 7 bytes, expected 8"):
        rs.encode_into([b"x" * 8] * 4, [bytearray(8), bytearray(7)])
    with pytest.raises(ShardSizeError, match="parity shard 4"):
        rs.reconstruct([None, b"x" * 8, b"x" * 8, b"x" * 8, b"x" * 7, None])


def test_unusable_buffers_raise() -> None:
    rs = codec.ReedSolomon(2, 2)
    with pytest.raises(CodecError, match="parity shard 3: bytes is not a writable"):
        rs.encode_into([b"ab", b"cd"], [bytearray(2), b"zz"])
    with pytest.raises(CodecError, match="data shard 1: str"):
        rs.encode([b"ab", "cd"])
    strided = np.zeros(8, dtype=np.uint8)[::2]
    with pytest.raises(CodecError, match="data shard 0: numpy.ndarray is not a contiguous"):
        rs.encode([strided, b"abcd"])
    with pytest.raises(CodecError, match="data shard 1: list has no buffer"):
        rs.reconstruct([None, [1, 2], b"ab", b"cd"])


def test_too_few_shards() -> None:
    rs, data, parity = stripe(4, 2, 10)
    with pytest.raises(TooFewShardsError, match=r"only 3 of 6 shards present \(\[1, 2, 4\]\); at least k=4"):
        rs.reconstruct([None, data[1], data[2], None, parity[0], None])
    with pytest.raises(TooFewShardsError, match=r"shards \[0\] are None"):
        rs.verify([None, data[1], data[2], data[3], parity[0], parity[1]])


def test_verify_checks_parity_sizes_and_types() -> None:
    rs, data, parity = stripe(4, 2, 10)
    with pytest.raises(ShardSizeError, match="parity shard 5 has 9 bytes, expected 10"):
        rs.verify(data + [parity[0], parity[1][:9]])
    with pytest.raises(CodecError, match="parity shard 4: int has no buffer"):
        rs.verify(data + [7, parity[1]])


def test_numpy_integers_are_accepted_for_k_and_m() -> None:
    assert codec.ReedSolomon(np.int64(4), np.uint8(2)).n == 6


# --- ISA selection ---------------------------------------------------------------------------
def test_isa_switching_in_process() -> None:
    before = codec.isa()
    assert before in codec.available_isas() and "scalar" in codec.available_isas()
    with codec.using_isa("scalar"):
        assert codec.isa() == "scalar"
    assert codec.isa() == before
    with pytest.raises(CodecError, match="unknown ISA 'avx9'"):
        codec.set_isa("avx9")


def run_python(code: str, isa: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEMSNAP_ISA=isa)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_environment_variable_forces_a_level() -> None:
    level = codec.available_isas()[0]
    done = run_python("from memsnap.coding import codec; print(codec.isa())", level)
    assert done.stdout.strip() == level, done.stderr
    bad = run_python("import memsnap.coding.codec", "quantum")
    assert bad.returncode != 0 and "MEMSNAP_ISA='quantum' is not available here" in bad.stderr


def test_encode_releases_the_gil() -> None:
    """With thread switching effectively off, the main thread can only run while the worker is
    inside encode_into if the C call released the GIL."""
    import threading

    rs = codec.ReedSolomon(4, 2)
    data = [np.ones(2 << 20, dtype=np.uint8) for _ in range(4)]
    parity = [np.empty(2 << 20, dtype=np.uint8) for _ in range(2)]
    started, finished = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        rs.encode_into(data, parity)
        finished.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        with codec.using_isa("scalar"):  # slow enough to be caught in the act
            worker = threading.Thread(target=work)
            worker.start()
            started.wait(timeout=60)
            inside = not finished.is_set()
            worker.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    assert inside and finished.is_set()
