"""The stripe layout: every byte in exactly one data shard, odd cache-line chunks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsnap.coding.stripes import LINE, StripeLayout, choose_chunk


def _covered(layout: StripeLayout) -> list[int]:
    hits = [0] * layout.nbytes
    for s in range(layout.stripes):
        for j in range(layout.k):
            start, stop = layout.data_range(s, j)
            assert 0 <= start <= stop <= layout.nbytes
            assert stop - start <= layout.chunk
            for b in range(start, stop):
                hits[b] += 1
    return hits


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 5000), k=st.integers(1, 8), lines=st.integers(1, 9))
def test_every_byte_in_exactly_one_shard(nbytes, k, lines):
    layout = StripeLayout(nbytes, k, lines * LINE)
    assert _covered(layout) == [1] * nbytes
    assert layout.padded_nbytes >= nbytes
    assert layout.padded_nbytes - nbytes < k * layout.chunk


@settings(max_examples=300, deadline=None)
@given(nbytes=st.integers(0, 1 << 34), k=st.integers(1, 16), target=st.integers(LINE, 8 << 20))
def test_chunk_has_an_odd_number_of_lines_near_target(nbytes, k, target):
    chunk = choose_chunk(nbytes, k, target)
    assert chunk % LINE == 0
    assert (chunk // LINE) % 2 == 1
    assert chunk <= target + 2 * LINE
    layout = StripeLayout(nbytes, k, chunk)
    # padding stays below one line per shard per stripe, plus the odd-line round-up
    assert layout.padded_nbytes - nbytes <= layout.stripes * k * 2 * LINE


def test_data_shards_of_a_stripe_are_never_a_power_of_two_apart():
    for nbytes in (1 << 20, 1 << 30, (1 << 30) + 12345, 3 << 28):
        for k in (1, 2, 4, 8):
            chunk = choose_chunk(nbytes, k)
            layout = StripeLayout(nbytes, k, chunk)
            starts = [layout.data_range(0, j)[0] for j in range(k)]
            gaps = {b - a for a, b in zip(starts, starts[1:])}
            assert all(g & (g - 1) for g in gaps), (nbytes, k, chunk)


def test_small_and_empty_streams():
    assert StripeLayout(0, 3, 64).stripes == 0
    assert choose_chunk(0, 3) == LINE
    layout = StripeLayout(100, 3, choose_chunk(100, 3))
    assert layout.stripes == 1
    assert [layout.data_range(0, j) for j in range(3)] == [(0, 64), (64, 100), (100, 100)]


@pytest.mark.parametrize("args, word", [((-1, 2, 64), "nbytes"), ((10, 0, 64), "k"), ((10, 2, 0), "chunk")])
def test_bad_layout_is_refused_by_name(args, word):
    with pytest.raises(ValueError, match=word):
        StripeLayout(*args)


def test_bad_choose_chunk_arguments_and_ranges():
    with pytest.raises(ValueError, match="target"):
        choose_chunk(10, 2, target=8)
    with pytest.raises(ValueError, match="k="):
        choose_chunk(10, 0)
    layout = StripeLayout(1000, 2, 128)
    with pytest.raises(IndexError, match="stripe"):
        layout.data_range(layout.stripes, 0)
    with pytest.raises(IndexError, match="shard"):
        layout.data_range(0, 2)
