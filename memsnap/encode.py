"""Stripe a node's bytes, encode their parity, and rebuild lost shards.

A node's byte stream is its local ranks' arena regions back to back, each region starting
on a stripe boundary (``Region.stripe_base``), so that no stripe straddles two ranks and a
rank's bytes can be rebuilt alone. Stripe ``s`` of a region has ``k`` data shards (views
straight into the arena; the last stripe's are zero-padded copies) and ``m`` parity shards
in the agent's parity buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from memsnap.stripes import StripeLayout
from memsnap.transport.base import ChunkKey


@dataclass(frozen=True)
class Region:
    """Rank ``rank``'s ``nbytes`` in its node's stream, from stripe ``stripe_base`` on."""

    rank: int
    nbytes: int
    stripe_base: int
    k: int
    chunk: int

    @property
    def layout(self) -> StripeLayout:
        return StripeLayout(self.nbytes, self.k, self.chunk)

    @property
    def stripes(self) -> int:
        return self.layout.stripes

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def regions(sizes: Mapping[int, int], k: int, chunk: int) -> list[Region]:
    """The regions of a node's ranks (``{rank: nbytes}``), in rank order, stripe-aligned."""
    out, base = [], 0
    for rank in sorted(sizes):
        region = Region(rank, sizes[rank], base, k, chunk)
        out.append(region)
        base += region.stripes
    return out


def parity_nbytes(regs: Sequence[Region], m: int) -> int:
    """Bytes of parity a node's regions need."""
    return sum(r.stripes for r in regs) * m * (regs[0].chunk if regs else 0)


class Encoded:
    """One region's shards: data views into ``data`` and parity views into ``parity``."""

    def __init__(self, region: Region, data: memoryview, parity: memoryview, m: int):
        self.region, self.m = region, m
        self.lay = region.layout
        self._data, self._parity = data, parity
        k, chunk = region.k, region.chunk
        last = self.lay.stripes - 1
        ragged = last >= 0 and self.lay.data_range(last, k - 1)[1] - self.lay.data_range(last, k - 1)[0] < chunk
        self._tail = bytearray(k * chunk) if ragged else None
        if ragged:
            for j in range(k):
                a, b = self.lay.data_range(last, j)
                self._tail[j * chunk:j * chunk + b - a] = data[a:b]

    def shard(self, stripe: int, j: int) -> memoryview:
        """Shard ``j`` of ``stripe``: ``chunk`` bytes (data for ``j < k``, parity after)."""
        k, chunk = self.region.k, self.region.chunk
        if j >= k:
            off = (stripe * self.m + j - k) * chunk
            return self._parity[off:off + chunk]
        if self._tail is not None and stripe == self.lay.stripes - 1:
            return memoryview(self._tail)[j * chunk:(j + 1) * chunk]
        a = (stripe * k + j) * chunk
        return self._data[a:a + chunk]

    def encode(self, codec) -> None:
        """Compute every stripe's parity into the parity buffer."""
        if self.m == 0:
            return
        k = self.region.k
        for s in range(self.lay.stripes):
            codec.encode_into([self.shard(s, j) for j in range(k)],
                              [self.shard(s, j) for j in range(k, k + self.m)])

    def items(self, step: int, owner: str, j: int) -> list[tuple[ChunkKey, memoryview]]:
        """Every stripe's shard ``j`` with its key, ready to push to holder ``j``."""
        base = self.region.stripe_base
        return [(ChunkKey(step, owner, base + s, j), self.shard(s, j)) for s in range(self.lay.stripes)]


def reconstruct_data(codec, shards: list, k: int) -> list:
    """The ``k`` data shards of a stripe from any ``k`` of its ``k+m`` (None where lost)."""
    if all(s is not None for s in shards[:k]):
        return list(shards[:k])
    return list(codec.reconstruct_data(shards))[:k]


def write_stripe(out: memoryview, lay: StripeLayout, stripe: int, data: Sequence,
                 in_place: frozenset[int] = frozenset()) -> None:
    """Copy a stripe's data shards into ``out`` (the region's bytes), clipped at the end.

    Shards listed in ``in_place`` were fetched straight into ``out`` and are not copied.
    """
    for j, shard in enumerate(data):
        a, b = lay.data_range(stripe, j)
        if b > a and j not in in_place:
            out[a:b] = memoryview(shard).cast("B")[:b - a]
