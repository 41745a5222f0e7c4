"""Stripe a node's bytes, encode their parity, and rebuild lost shards.

A node's byte stream is its local ranks' arena regions back to back, each region starting
on a stripe boundary (``StripedRegion.stripe_base``), so that no stripe straddles two ranks and a
rank's bytes can be rebuilt alone. Stripe ``s`` of a region has ``k`` data shards (views
straight into the arena; the last stripe's are zero-padded copies) and ``m`` parity shards,
computed a batch of stripes at a time into a small scratch buffer (``ParityBatch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memsnap.coding.stripes import ChunkKey, StripeLayout

if TYPE_CHECKING:
    from memsnap.records import RankSource


@dataclass(frozen=True)
class StripedRegion:
    """Rank ``rank``'s ``nbytes`` in its node's stream, from stripe ``stripe_base`` on, cut into
    stripes of ``k`` shards of ``chunk`` bytes (the wire record ``records.Region`` plus ``k`` and
    ``chunk``)."""

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

    @classmethod
    def of(cls, src: RankSource) -> StripedRegion:
        """The layout of the rank's bytes a restore source names."""
        return cls(src.region.rank, src.region.nbytes, src.region.stripe_base, src.k, src.chunk)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def shard_of(region: StripedRegion, data: memoryview, stripe: int, j: int) -> memoryview:
    """Data shard ``j < k`` of ``stripe`` of ``region`` (bytes ``data``): a view, or for a
    clipped last stripe a zero-padded copy."""
    a, b = region.layout.data_range(stripe, j)
    if b - a == region.chunk:
        return data[a:b]
    out = bytearray(region.chunk)
    out[: b - a] = data[a:b]
    return memoryview(out)


def regions(sizes: Mapping[int, int], k: int, chunk: int) -> list[StripedRegion]:
    """The regions of a node's ranks (``{rank: nbytes}``), in rank order, stripe-aligned."""
    out, base = [], 0
    for rank in sorted(sizes):
        region = StripedRegion(rank, sizes[rank], base, k, chunk)
        out.append(region)
        base += region.stripes
    return out


class Encoded:
    """One region's data shards: views straight into ``data`` (the last stripe's padded)."""

    def __init__(self, region: StripedRegion, data: memoryview):
        self.region = region
        self.lay = region.layout
        self._data = data
        k, chunk = region.k, region.chunk
        last = self.lay.stripes - 1
        ragged = last >= 0 and self.lay.data_range(last, k - 1)[1] - self.lay.data_range(last, k - 1)[0] < chunk
        self._tail = bytearray(k * chunk) if ragged else None
        if self._tail is not None:
            for j in range(k):
                a, b = self.lay.data_range(last, j)
                self._tail[j * chunk : j * chunk + b - a] = data[a:b]

    def shard(self, stripe: int, j: int) -> memoryview:
        """Data shard ``j < k`` of ``stripe``: ``chunk`` bytes."""
        k, chunk = self.region.k, self.region.chunk
        if not 0 <= j < k:
            raise IndexError(f"shard {j}: a region holds data shards 0..{k - 1}; parity is in a ParityBatch")
        if self._tail is not None and stripe == self.lay.stripes - 1:
            return memoryview(self._tail)[j * chunk : (j + 1) * chunk]
        a = (stripe * k + j) * chunk
        return self._data[a : a + chunk]

    def items(self, step: int, owner: str, j: int) -> list[tuple[ChunkKey, memoryview]]:
        """Every stripe's data shard ``j`` with its key, ready to push to holder ``j``."""
        base = self.region.stripe_base
        return [(ChunkKey(step, owner, base + s, j), self.shard(s, j)) for s in range(self.lay.stripes)]


class ParityBatch:
    """The parity of a run of stripes (``[(region, stripe), ...]``), computed into ``buf``.

    Parity is produced a batch at a time into a small scratch buffer that is reused once the
    batch has been pushed, so an owner never holds a whole snapshot's parity (S*m/k bytes).
    """

    def __init__(self, members: Sequence[tuple[Encoded, int]], m: int, chunk: int, buf: memoryview):
        if len(buf) < len(members) * m * chunk:
            raise ValueError(f"parity buffer of {len(buf)} bytes, {len(members) * m * chunk} needed")
        self.members, self.m, self.chunk, self.buf = list(members), m, chunk, buf

    def shard(self, i: int, p: int) -> memoryview:
        """Parity shard ``p`` (0-based) of the batch's ``i``-th stripe."""
        off = (i * self.m + p) * self.chunk
        return self.buf[off : off + self.chunk]

    def encode(self, codec) -> None:
        for i, (enc, s) in enumerate(self.members):
            codec.encode_into([enc.shard(s, j) for j in range(enc.region.k)], [self.shard(i, p) for p in range(self.m)])

    def items(self, step: int, owner: str, j: int) -> list[tuple[ChunkKey, memoryview]]:
        """Shard ``j >= k`` (parity ``j - k``) of every stripe of the batch, keyed."""
        return [
            (ChunkKey(step, owner, enc.region.stripe_base + s, j), self.shard(i, j - enc.region.k))
            for i, (enc, s) in enumerate(self.members)
        ]


def batches(encs: Sequence[Encoded], per_batch: int) -> list[list[tuple[Encoded, int]]]:
    """Every stripe of ``encs`` in order, cut into runs of at most ``per_batch``."""
    flat = [(enc, s) for enc in encs for s in range(enc.lay.stripes)]
    return [flat[i : i + per_batch] for i in range(0, len(flat), max(1, per_batch))]


def reconstruct_data(codec, shards: list, k: int) -> list:
    """The ``k`` data shards of a stripe from any ``k`` of its ``k+m`` (None where lost)."""
    if all(s is not None for s in shards[:k]):
        return list(shards[:k])
    return list(codec.reconstruct_data(shards))[:k]


def write_stripe(out, lay: StripeLayout, stripe: int, data: Sequence, in_place: frozenset[int] = frozenset()) -> None:
    """Copy a stripe's data shards into ``out`` (the region's bytes, a memoryview or a
    ``landing.Flat``/``Spans``), clipped at the end.

    Shards listed in ``in_place`` were fetched straight into ``out`` and are not copied.
    """
    for j, shard in enumerate(data):
        a, b = lay.data_range(stripe, j)
        if b > a and j not in in_place:
            src = memoryview(shard).cast("B")[: b - a]
            if isinstance(out, memoryview):
                out[a:b] = src
            else:
                out.write(a, src)
