"""Systematic Reed-Solomon erasure coding over GF(2^8), backed by the native SIMD kernels.

A stripe is ``k`` data shards plus ``m`` parity shards, all of one length; any ``k`` of the
``k + m`` rebuild the rest.  Buffer conventions (as in klauspost/reedsolomon):

* Shards are any objects exposing a C-contiguous buffer: ``bytes``, ``memoryview``, numpy
  ``uint8`` arrays, pyarrow ``Buffer`` (a CPU torch tensor through ``t.numpy()``).  They are
  read in place, never copied.
* ``encode`` returns new numpy arrays; ``encode_into`` writes caller-owned writable buffers
  and allocates nothing.
* ``reconstruct`` takes ``k + m`` entries with ``None`` for a lost shard and returns a new list
  in which the present entries are the very objects passed in and the lost ones are new numpy
  arrays.  It does not check the present shards: ``verify`` does.

The generator is ``[I; G]``: for ``m == 2`` the RAID-6 rows ``P = xor``, ``Q = sum 2^i d_i``;
otherwise a Cauchy matrix scaled so that the first parity is the XOR of the data and ``k == 1``
is replication.  Both are MDS.  The C kernels release the GIL; ``threads`` splits one call
across cores.  ``MEMSNAP_ISA=scalar|ssse3|avx2`` forces a kernel level at import.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from memsnap import _codec
from memsnap.errors import CodecError, ShardSizeError, TooFewShardsError

__all__ = [
    "CodecError",
    "ReedSolomon",
    "ShardSizeError",
    "TooFewShardsError",
    "available_isas",
    "isa",
    "set_isa",
    "using_isa",
]

_ISA_ENV = "MEMSNAP_ISA"


def isa() -> str:
    """The kernel level in use: ``scalar``, ``ssse3`` or ``avx2``."""
    return _codec.isa()


def available_isas() -> list[str]:
    """Kernel levels this CPU (and build) can run, slowest first."""
    return _codec.available_isas()


def set_isa(name: str) -> None:
    """Switch every codec in this process to kernel level ``name``."""
    if not isinstance(name, str):
        raise CodecError(f"ISA name must be a str like 'avx2', got {name!r}")
    _codec.set_isa(name)


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[str]:
    """Run the block with kernel level ``name``, restoring the previous one afterwards."""
    previous = isa()
    set_isa(name)
    try:
        yield name
    finally:
        set_isa(previous)


def _apply_env_isa() -> None:
    forced = os.environ.get(_ISA_ENV, "").strip().lower()
    if not forced:
        return
    if forced not in available_isas():
        raise CodecError(f"{_ISA_ENV}={forced!r} is not available here; use one of {available_isas()} or unset it")
    set_isa(forced)


_apply_env_isa()


def _resolve_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise CodecError(f"threads={threads!r} must be an int >= 1, or 0 for one per CPU core")
    return threads or (os.cpu_count() or 1)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise CodecError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise CodecError(f"{name}={value!r} must be an int") from None


def _nbytes(shard: Any, index: int, k: int) -> int:
    try:
        return memoryview(shard).nbytes
    except TypeError:
        kind = "data" if index < k else "parity"
        raise CodecError(
            f"{kind} shard {index}: {type(shard).__name__} has no buffer; pass bytes, a "
            "memoryview, a numpy uint8 array or a pyarrow Buffer (torch: t.numpy())"
        ) from None


class ReedSolomon:
    """A ``k + m`` Reed-Solomon code; one instance is safe to share between threads."""

    def __init__(self, k: int, m: int, *, threads: int = 1) -> None:
        k, m = _as_int("k", k), _as_int("m", m)
        if k < 1 or m < 0 or k + m > 256:
            raise CodecError(f"k={k}, m={m} out of range: need 1 <= k, 0 <= m and k + m <= 256 (GF(2^8))")
        self.k, self.m, self.threads = k, m, _resolve_threads(threads)
        self._parity = _codec.generator(k, m)
        self._parity_tables = _codec.tables(self._parity)
        identity = np.eye(k, dtype=np.uint8).tobytes()
        self._full = identity + self._parity
        self._plans: dict[tuple[tuple[int, ...], bool], tuple] = {}  # per loss pattern
        self._data_ids = tuple(range(k))
        self._parity_ids = tuple(range(k, k + m))

    def __repr__(self) -> str:
        return f"ReedSolomon(k={self.k}, m={self.m}, threads={self.threads})"

    @property
    def n(self) -> int:
        """Shards per stripe, ``k + m``."""
        return self.k + self.m

    def generator(self) -> np.ndarray:
        """The ``m x k`` parity rows of the generator ``[I; G]`` (a copy)."""
        return np.frombuffer(self._parity, dtype=np.uint8).reshape(self.m, self.k).copy()

    # --- encoding ------------------------------------------------------------------------
    def encode(self, data: Sequence[Any]) -> list[np.ndarray]:
        """Return the ``m`` parity shards of ``k`` equal-length data shards as new arrays."""
        self._check_count(data, self.k, "data shards")
        length = _nbytes(data[0], 0, self.k)
        parity = [np.empty(length, dtype=np.uint8) for _ in range(self.m)]
        self.encode_into(data, parity)
        return parity

    def encode_into(self, data: Sequence[Any], parity: Sequence[Any]) -> None:
        """Write the parity of ``data`` into the ``m`` caller-owned writable buffers ``parity``."""
        self._check_count(data, self.k, "data shards")
        self._check_count(parity, self.m, "parity buffers")
        _codec.apply(
            self._parity,
            self._parity_tables,
            self.m,
            self.k,
            data,
            parity,
            self.threads,
            self._data_ids,
            self._parity_ids,
            self.k,
        )

    # --- decoding ------------------------------------------------------------------------
    def reconstruct(self, shards: Sequence[Any], *, out: Mapping[int, Any] | None = None) -> list[Any]:
        """Return all ``k + m`` shards, rebuilding the ``None`` entries from any ``k`` others.

        ``out`` optionally maps a lost shard's index to a writable buffer to rebuild it into
        (instead of a new array), e.g. a slot of a preallocated receive arena.
        """
        return self._rebuild(shards, False, out)

    def reconstruct_data(self, shards: Sequence[Any], *, out: Mapping[int, Any] | None = None) -> list[Any]:
        """Like ``reconstruct`` but rebuild only data shards; lost parity stays ``None``."""
        return self._rebuild(shards, True, out)

    def verify(self, shards: Sequence[Any]) -> bool:
        """True when the parity shards match the data shards; every shard must be present."""
        self._check_count(shards, self.n, "shards (k + m)")
        lost = [i for i, s in enumerate(shards) if s is None]
        if lost:
            raise TooFewShardsError(f"verify needs every shard; shards {lost} are None (rebuild them with reconstruct)")
        expected = self.encode(shards[: self.k])
        length = len(expected[0]) if expected else _nbytes(shards[0], 0, self.k)
        for j, want in enumerate(expected):
            size = _nbytes(shards[self.k + j], self.k + j, self.k)
            if size != length:
                raise ShardSizeError(
                    f"parity shard {self.k + j} has {size} bytes, expected {length} "
                    "like data shard 0: all shards of a stripe must have the same length"
                )
            if not np.array_equal(np.frombuffer(shards[self.k + j], dtype=np.uint8), want):
                return False
        return True

    def _rebuild(self, shards: Sequence[Any], data_only: bool, out_bufs: Mapping[int, Any] | None) -> list[Any]:
        self._check_count(shards, self.n, "shards (k + m)")
        lost = tuple([i for i, s in enumerate(shards) if s is None])
        plan = self._plans.get((lost, data_only)) or self._plan(lost, data_only)
        out = list(shards)
        used, wanted, coef, tables, pqd = plan
        if not wanted:
            return out
        inputs = [shards[i] for i in used]
        try:
            rebuilt = [out_bufs[i] for i in wanted]  # type: ignore[index]
        except (KeyError, TypeError):
            bufs = out_bufs or {}
            length = _nbytes(inputs[0], used[0], self.k)
            rebuilt = [bufs[i] if i in bufs else np.empty(length, np.uint8) for i in wanted]
        _codec.apply(coef, tables, len(wanted), self.k, inputs, rebuilt, self.threads, used, wanted, self.k, *pqd)
        for i, arr in zip(wanted, rebuilt):
            out[i] = arr
        return out

    def _plan(self, lost: tuple[int, ...], data_only: bool) -> tuple:
        """Which k shards to read, which to rebuild, and the decode matrix, per loss pattern."""
        present = [i for i in range(self.n) if i not in lost]
        if len(present) < self.k:
            raise TooFewShardsError(
                f"only {len(present)} of {self.n} shards present ({present}); at least k={self.k} "
                "are needed to rebuild a stripe"
            )
        used = tuple(present[: self.k])
        wanted = tuple(i for i in lost if i < self.k) if data_only else lost
        coef = _codec.decode_matrix(self._full, self.k, used, wanted) if wanted else b""
        # two lost data shards of a RAID-6 stripe: the C side may use the syndrome kernel
        pqd = wanted if self.m == 2 and len(wanted) == 2 and wanted[1] < self.k else ()
        plan = (used, wanted, coef, _codec.tables(coef), pqd)
        self._plans[(lost, data_only)] = plan
        return plan

    @staticmethod
    def _check_count(items: Sequence[Any], expected: int, what: str) -> None:
        try:
            count = len(items)
        except TypeError:
            raise CodecError(f"expected a list of {expected} {what}, got {type(items).__name__}") from None
        if count != expected:
            raise CodecError(f"expected {expected} {what}, got {count}")


def codec_for(k: int, m: int) -> ReedSolomon | None:
    """The codec of RS(``k``, ``m``); None without parity (``m=0``: nothing to encode)."""
    return None if m == 0 else ReedSolomon(k, m)
