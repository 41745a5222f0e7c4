"""A rank's data file straight from its tensors: the bytes ``capture`` would lay out in its
buffer, produced in order without a staging copy of the state.

``TensorStream(manifest, sources)`` (from ``capture.plan_sources``) yields the file piece by
piece: a large CPU tensor's own memory in ``PIECE``-sized slices, small tensors and the zero
padding between tensors gathered into blocks of up to ``PIECE`` bytes. Each tensor's xxh3 is
computed on the pieces as they go by, so a writer that hashes and writes each piece
(``storage.Store.write_rank_stream``) reads every byte from memory once while it is still in
cache: one pass for both checksums and the write, where capture + ``fill_checksums`` + a
buffer write made four.

A tensor that is not a plain contiguous CPU tensor (CUDA, strided, lazily conjugated or
negated) is first made one, that tensor alone; the stream keeps those copies alive until it
is dropped, since a writer may hold on to a piece until it closes its file.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import xxhash

from memsnap.state.capture import tensor_bytes
from memsnap.state.checksum import checksum
from memsnap.state.manifest import Manifest

PIECE = 2 << 20  # hashed twice and written while it is still in the CPU's cache
SMALL = 256 << 10  # tensors below this are gathered with their neighbours into one write


def host_tensor(src: torch.Tensor) -> torch.Tensor:
    """``src`` as a contiguous CPU tensor holding its plain values: ``src`` itself when it is
    one already, else a copy."""
    if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        return src
    return src.detach().to("cpu").resolve_conj().resolve_neg().contiguous()


class _Blocks:
    """Gathers small pieces (small tensors, padding) into blocks of up to ``size`` bytes; a
    block is never reused once handed out."""

    def __init__(self, size: int):
        self.size = size
        self.block = bytearray(size)
        self.used = 0

    def add(self, data: memoryview | None, nbytes: int) -> Iterator[memoryview]:
        """Append ``data`` (None: ``nbytes`` zeros), yielding every block that fills up."""
        done = 0
        while done < nbytes:
            if self.used == self.size:
                yield from self.flush()
            n = min(nbytes - done, self.size - self.used)
            if data is not None:
                self.block[self.used : self.used + n] = data[done : done + n]
            self.used += n
            done += n

    def flush(self) -> Iterator[memoryview]:
        """Yield the block gathered so far, if any, and start a fresh one (zeroed)."""
        if self.used:
            yield memoryview(self.block)[: self.used]
            self.block, self.used = bytearray(self.size), 0


class TensorStream:
    """The data file of ``manifest`` (a layout from ``capture.plan_sources``, with ``sources``
    its tensors in manifest order), produced piece by piece; see the module docstring.

    Iterate it once, completely; then ``manifest()`` is ``manifest`` with every stored
    tensor's xxh3 (what ``fill_checksums`` gives for the captured buffer).
    """

    def __init__(self, manifest: Manifest, sources: list[torch.Tensor], *, piece: int = PIECE, small: int = SMALL):
        if len(sources) != len(manifest.tensors):
            raise ValueError(f"{len(sources)} tensors for a manifest of {len(manifest.tensors)}")
        self.nbytes = manifest.nbytes
        self._layout, self._sources = manifest, sources
        self._piece, self._small = piece, small
        self._sums: list[str | None] | None = None
        self._held: list[torch.Tensor] = []  # host copies a writer may still be reading

    def __iter__(self) -> Iterator[memoryview]:
        sums: list[str | None] = [None] * len(self._sources)
        blocks, pos = _Blocks(self._piece), 0
        for i, (entry, src) in enumerate(zip(self._layout.tensors, self._sources)):
            if entry.alias_of is not None:
                continue
            yield from blocks.add(None, entry.offset - pos)  # the padding before it: zeros
            host = host_tensor(src)
            if host is not src:
                self._held.append(host)
            sums[i] = yield from self._tensor(blocks, host, entry.nbytes)
            pos = entry.offset + entry.nbytes
        yield from blocks.add(None, self.nbytes - pos)
        yield from blocks.flush()
        self._sums = sums

    def _tensor(self, blocks: _Blocks, host: torch.Tensor, nbytes: int):
        """Yield one tensor's bytes (gathered when small, its own memory when large); return
        their xxh3."""
        data = tensor_bytes(host, nbytes)
        if nbytes < self._small:
            yield from blocks.add(data, nbytes)
            return checksum(data)
        yield from blocks.flush()
        h = xxhash.xxh3_64()
        for start in range(0, nbytes, self._piece):
            part = data[start : start + self._piece]
            h.update(part)
            yield part
        return h.hexdigest()

    def manifest(self) -> Manifest:
        """The layout with every stored tensor's checksum; only after a complete iteration."""
        if self._sums is None:
            raise RuntimeError("the stream has not been written out yet; its checksums are not known")
        return self._layout.with_checksums(self._sums)
