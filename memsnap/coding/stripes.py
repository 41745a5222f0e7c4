"""The stripe layout: which bytes of a node's stream form shard j of stripe s, and the key
(``ChunkKey``) that names one such shard wherever it is sent or held."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memsnap.records import Region

LINE = 64  # bytes per cache line; chunks are whole lines


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StripeLayout:
    """A node's ``nbytes`` cut into stripes of ``k`` data shards of ``chunk`` bytes each.

    Stripe ``s`` covers bytes ``[s*k*chunk, (s+1)*k*chunk)`` of the stream and its shard ``j``
    the ``j``-th ``chunk`` of that. The last stripe may run past ``nbytes``: its shards are
    clipped by ``data_range`` and zero-padded to ``chunk`` by whoever encodes them.
    """

    nbytes: int
    k: int
    chunk: int

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"nbytes={self.nbytes!r}: must be an int >= 0")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k={self.k!r}: must be an int >= 1 (k=1 is replication)")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk={self.chunk!r}: must be an int >= 1; see choose_chunk()")

    @property
    def stripes(self) -> int:
        """How many stripes cover the stream (0 for an empty stream)."""
        return _ceil_div(self.nbytes, self.k * self.chunk)

    @property
    def padded_nbytes(self) -> int:
        """The stream's length rounded up to whole stripes."""
        return self.stripes * self.k * self.chunk

    def data_range(self, stripe: int, shard: int) -> tuple[int, int]:
        """``(start, stop)`` of data shard ``shard`` of ``stripe`` in the stream, clipped to nbytes."""
        if not 0 <= stripe < self.stripes:
            raise IndexError(f"stripe={stripe}: this layout has stripes 0..{self.stripes - 1}")
        if not 0 <= shard < self.k:
            raise IndexError(f"shard={shard}: data shards are 0..{self.k - 1} (parity has no range)")
        start = (stripe * self.k + shard) * self.chunk
        return min(start, self.nbytes), min(start + self.chunk, self.nbytes)


def stripes_of(regions: Iterable[Region], k: int, chunk: int) -> int:
    """How many stripes a node's stream of ``regions`` has (each region starts on a stripe)."""
    return sum(StripeLayout(r.nbytes, k, chunk).stripes for r in regions)


def choose_chunk(nbytes: int, k: int, target: int = 4 << 20) -> int:
    """A shard size near ``target`` for ``nbytes`` cut into stripes of ``k`` shards.

    The result is a multiple of 64 with an odd number of 64-byte lines, so that the ``k``
    data shards of a stripe never sit a power of two apart (cache-set conflicts in the
    codec), and is sized so that the last stripe wastes little padding.
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: must be an int >= 0")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be an int >= 1")
    if not isinstance(target, int) or target < LINE:
        raise ValueError(f"target={target!r}: must be an int >= {LINE} (one cache line)")
    stripes = max(1, _ceil_div(nbytes, k * target))
    lines = max(1, _ceil_div(nbytes, stripes * k * LINE))
    if lines % 2 == 0:
        lines += 1
    return lines * LINE


# step (u64), stripe (u32), shard (u16), len(owner utf-8) (u16), then the owner bytes.
_KEY_HEAD = struct.Struct("<QIHH")
MAX_OWNER_BYTES = 0xFFFF


@dataclass(frozen=True, order=True)
class ChunkKey:
    """One chunk: shard ``shard`` of stripe ``stripe`` of node ``owner``'s bytes at ``step``.

    ``owner`` is the node id whose snapshot bytes the chunk comes from (not the holder).
    """

    step: int
    owner: str
    stripe: int
    shard: int

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not self.owner:
            raise ValueError(f"ChunkKey owner={self.owner!r}: pass the owner's node id as a non-empty str")
        for name, bound in (("step", 1 << 64), ("stripe", 1 << 32), ("shard", 1 << 16)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < bound:
                raise ValueError(f"ChunkKey {name}={value!r}: must be an int in [0, {bound})")
        if len(self.owner.encode()) > MAX_OWNER_BYTES:
            raise ValueError(f"ChunkKey owner is {len(self.owner.encode())} bytes; at most {MAX_OWNER_BYTES}")

    def pack(self) -> bytes:
        """The key as bytes: a fixed little-endian header and the owner's utf-8."""
        owner = self.owner.encode()
        return _KEY_HEAD.pack(self.step, self.stripe, self.shard, len(owner)) + owner

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkKey:
        """The key ``pack`` wrote; ValueError for anything else."""
        raw = bytes(raw)
        if len(raw) < _KEY_HEAD.size:
            raise ValueError(f"a packed ChunkKey is at least {_KEY_HEAD.size} bytes, got {len(raw)}")
        step, stripe, shard, n = _KEY_HEAD.unpack_from(raw)
        if len(raw) != _KEY_HEAD.size + n:
            raise ValueError(f"packed ChunkKey says owner is {n} bytes but {len(raw) - _KEY_HEAD.size} follow")
        return cls(step, raw[_KEY_HEAD.size :].decode(), stripe, shard)
