"""Every kernel level against the reference kernel and the pure-Python oracle, byte for byte."""

from __future__ import annotations

import ctypes
import itertools
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import gf_oracle as oracle

from memsnap.coding import codec

ISAS = codec.available_isas()
FAST_ISAS = [i for i in ISAS if i != "scalar"]
# lengths around every block size (16/32/64 bytes) and the scalar tails
LENGTHS = [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4095, 4096, 4097]
GEOMETRIES = [
    (1, 1),
    (1, 3),
    (2, 1),
    (3, 2),
    (4, 1),
    (4, 2),
    (5, 3),
    (6, 3),
    (4, 4),
    (4, 5),
    (8, 2),
    (10, 4),
    (3, 9),
    (2, 0),
]


def random_shards(rng: np.random.Generator, count: int, length: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(count)]


def encode_with(isa: str, rs: codec.ReedSolomon, data) -> list[bytes]:
    with codec.using_isa(isa):
        return [p.tobytes() for p in rs.encode(data)]


@pytest.mark.parametrize("k,m", GEOMETRIES)
def test_every_isa_matches_the_oracle_for_every_length(k: int, m: int) -> None:
    rng = np.random.default_rng(k * 100 + m)
    rs = codec.ReedSolomon(k, m)
    for length in LENGTHS:
        data = random_shards(rng, k, length)
        want = [p.tobytes() for p in oracle.matvec(oracle.generator(k, m), data)] if m else []
        for isa in ISAS:
            assert encode_with(isa, rs, data) == want, (isa, length)


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_kernels_equal_reference_on_large_random_geometries(isa: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(12):
        k = int(rng.integers(1, 40))
        m = int(rng.integers(1, 12))
        length = int(rng.integers(0, 3000))
        rs = codec.ReedSolomon(k, m)
        data = random_shards(rng, k, length)
        assert encode_with(isa, rs, data) == encode_with("scalar", rs, data), (k, m, length)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_matches_oracle_for_every_loss_pattern(isa: str) -> None:
    rng = np.random.default_rng(3)
    for k, m in [(1, 2), (2, 1), (3, 2), (4, 2), (4, 3), (5, 3)]:
        rs = codec.ReedSolomon(k, m)
        data = random_shards(rng, k, 77)
        full = data + oracle.matvec(oracle.generator(k, m), data)
        with codec.using_isa(isa):
            for lost_count in range(1, m + 1):
                for lost in itertools.combinations(range(k + m), lost_count):
                    shards = [None if i in lost else s for i, s in enumerate(full)]
                    out = rs.reconstruct(shards)
                    for i in range(k + m):
                        assert bytes(out[i]) == full[i].tobytes(), (k, m, lost, i)


@pytest.mark.parametrize("isa", ISAS)
def test_random_loss_patterns_for_large_geometries(isa: str) -> None:
    rng = np.random.default_rng(11)
    for k, m in [(10, 4), (17, 7), (32, 8), (200, 56)]:
        rs = codec.ReedSolomon(k, m)
        data = random_shards(rng, k, 97)
        full = data + [np.frombuffer(p, np.uint8) for p in encode_with("scalar", rs, data)]
        with codec.using_isa(isa):
            for _ in range(3):
                lost = set(rng.choice(k + m, m, replace=False).tolist())
                shards = [None if i in lost else s for i, s in enumerate(full)]
                out = rs.reconstruct(shards)
                assert all(bytes(out[i]) == full[i].tobytes() for i in lost), (k, m, lost)


@pytest.mark.parametrize("isa", ISAS)
def test_misaligned_views(isa: str) -> None:
    rng = np.random.default_rng(5)
    backing = rng.integers(0, 256, 8 * 300 + 64, dtype=np.uint8)
    rs = codec.ReedSolomon(4, 3)
    for shift in range(1, 33, 5):
        data = [memoryview(backing)[shift + i * 301 : shift + i * 301 + 257] for i in range(4)]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
        parity_backing = np.zeros(3 * 300 + 64, dtype=np.uint8)
        parity = [memoryview(parity_backing)[shift + j * 299 : shift + j * 299 + 257] for j in range(3)]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
        with codec.using_isa(isa):
            rs.encode_into(data, parity)
        want = oracle.matvec(oracle.generator(4, 3), [np.frombuffer(d, np.uint8) for d in data])
        assert [bytes(p) for p in parity] == [w.tobytes() for w in want], shift


class GuardedPages:
    """Anonymous pages followed by a PROT_NONE page: reading or writing past the end faults."""

    PAGE = mmap.PAGESIZE

    def __init__(self, pages: int) -> None:
        self.size = pages * self.PAGE
        self.map = mmap.mmap(-1, self.size + self.PAGE)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        base = self.array.ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mprotect(ctypes.c_void_p(base + self.size), self.PAGE, 0) != 0:
            pytest.skip("mprotect unavailable")

    def ending_at_guard(self, length: int, slot: int, slots: int) -> np.ndarray:
        """A view of `length` bytes whose last byte sits right before the guard page (slot 0),
        or right before an earlier page boundary (other slots)."""
        end = self.size - slot * (self.size // slots)
        end -= end % self.PAGE
        return self.array[end - length : end]


@pytest.mark.parametrize("isa", ISAS)
def test_buffers_ending_at_a_page_boundary(isa: str) -> None:
    rng = np.random.default_rng(9)
    k, m = 3, 2
    rs = codec.ReedSolomon(k, m)
    for length in (1, 31, 33, 100, 4095):
        pages = GuardedPages(2 * (k + m) + 2)
        views = [pages.ending_at_guard(length, s, k + m) for s in range(k + m)]
        for v in views[:k]:
            v[:] = rng.integers(0, 256, length, dtype=np.uint8)
        # parity 0 ends at the guard page: any overrun faults
        data, parity = views[m:], views[:m]
        with codec.using_isa(isa):
            rs.encode_into(data, parity)
            want = oracle.matvec(oracle.generator(k, m), data)
            assert [p.tobytes() for p in parity] == [w.tobytes() for w in want]
            out = rs.reconstruct([None, data[1], data[2], parity[0], None])
        assert out[0].tobytes() == data[0].tobytes()


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 12),
    m=st.integers(0, 6),
    length=st.integers(0, 300),
    offset=st.integers(0, 31),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_property_any_k_shards_rebuild_the_stripe(k, m, length, offset, seed, data) -> None:
    rng = np.random.default_rng(seed)
    backing = rng.integers(0, 256, offset + k * length + 1, dtype=np.uint8)
    shards = [backing[offset + i * length : offset + (i + 1) * length] for i in range(k)]
    rs = codec.ReedSolomon(k, m)
    isa = data.draw(st.sampled_from(ISAS))
    with codec.using_isa(isa):
        parity = rs.encode(shards)
        full = shards + parity
        assert rs.verify(full)
        lost = data.draw(st.sets(st.integers(0, k + m - 1), max_size=m))
        out = rs.reconstruct([None if i in lost else s for i, s in enumerate(full)])
    assert all(bytes(out[i]) == bytes(full[i]) for i in range(k + m))
    want = oracle.matvec(oracle.generator(k, m), shards) if m else []
    assert [p.tobytes() for p in parity] == [w.tobytes() for w in want]


@pytest.mark.parametrize("isa", FAST_ISAS)
@pytest.mark.parametrize("k,m", [(4, 2), (3, 1), (5, 3)])
def test_large_outputs_with_shared_and_mixed_misalignment(isa: str, k: int, m: int) -> None:
    """Outputs long enough for streaming stores, misaligned alike (streamed) and unalike (not)."""
    rng = np.random.default_rng(13)
    length = (600 << 10) + 7
    data = random_shards(rng, k, length)
    rs = codec.ReedSolomon(k, m)
    want = encode_with("scalar", rs, data)
    for shifts in ([5] * m, list(range(1, m + 1))):
        backing = [np.zeros(length + 128, dtype=np.uint8) for _ in range(m)]
        parity = [b[(-b.ctypes.data) % 64 + s :][:length] for b, s in zip(backing, shifts)]
        with codec.using_isa(isa):
            rs.encode_into(data, parity)
        assert [p.tobytes() for p in parity] == want, shifts


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [2, 4, 9])
def test_raid6_double_data_loss_on_long_shards(isa: str, k: int) -> None:
    """Two lost data shards of an m=2 stripe (the syndrome path on AVX2), long and short."""
    rng = np.random.default_rng(17 + k)
    rs = codec.ReedSolomon(k, 2)
    for length in ((600 << 10) + 7, 191):
        data = random_shards(rng, k, length)
        full = data + rs.encode(data)
        for a, b in [(0, 1), (0, k - 1), (k - 2, k - 1)]:
            shards = [None if i in (a, b) else s for i, s in enumerate(full)]
            target = np.zeros(length + 3, dtype=np.uint8)[3:]  # misaligned output
            with codec.using_isa(isa):
                out = rs.reconstruct_data(shards, out={b: target})
            assert np.array_equal(out[a], data[a]) and np.array_equal(target, data[b]), (a, b)
