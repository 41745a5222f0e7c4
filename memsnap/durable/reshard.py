"""A step saved by another world size, read from durable storage: the saved rank files, each
read and verified whole, as the reader that ``state.reshard`` fills the live layout from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from memsnap.durable.layout import rank_name
from memsnap.durable.storage import Store
from memsnap.errors import FormatError
from memsnap.state.capture import plan
from memsnap.state.dtypes import dtype_of
from memsnap.state.manifest import Manifest, TensorEntry
from memsnap.state.reshard import fill, fill_sharded, layout


class _Reader:
    """Saved tensors from their rank files, each file read and verified whole, once, by
    ``Store.read_rank`` (size and xxh3 against ``COMMITTED``, every tensor's checksum) before
    any of its tensors is used."""

    def __init__(self, store: Store, step: int, saved: list[Manifest], marker: dict):
        self.store, self.step, self.saved, self.marker = store, step, saved, marker
        self.files: dict[int, memoryview] = {}

    def entry(self, rank: int, path: str) -> TensorEntry:
        try:
            return self.saved[rank].entry(path)
        except KeyError:
            raise FormatError(
                f"{self.store.path(self.step, rank_name(rank, 'json'))} has no tensor "
                f"{path!r} although rank 0's manifest does; the step is damaged, load "
                "another step"
            ) from None

    def holder(self, rank: int, path: str) -> TensorEntry:
        e = self.entry(rank, path)
        return self.entry(rank, e.alias_of) if e.alias_of else e

    def data(self, rank: int) -> memoryview:
        """Saved rank ``rank``'s verified data file."""
        if rank not in self.files:
            _, self.files[rank] = self.store.read_rank(self.step, rank, marker=self.marker, manifest=self.saved[rank])
        return self.files[rank]

    def tensor(self, rank: int, path: str) -> torch.Tensor:
        e = self.holder(rank, path)
        dtype = dtype_of(e.dtype)
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        raw = torch.frombuffer(self.data(rank)[e.offset : e.offset + e.nbytes], dtype=torch.uint8)
        return raw.view(dtype).view(e.shape)


def assemble(store: Store, step: int, marker: dict, state: Mapping[str, Any], rank: int) -> tuple[Manifest, Any]:
    """Rank ``rank``'s manifest and buffer of ``step`` in the layout of the live ``state``."""
    world = marker["world_size"]
    saved = [store.manifest(step, r, marker) for r in range(world)]
    target = layout(saved, plan(state), rank)
    return target, fill(target, saved, _Reader(store, step, saved, marker), rank)


def full_tensors(store: Store, step: int, paths: list[str], marker: dict | None = None):
    """Yield ``(path, full tensor)`` for each path: DTensor shards from every saved rank joined
    into the global tensor, plain tensors from rank 0. Every rank file read is verified whole
    (``Store.read_rank``) and the shards must tile each tensor (``tiling``)."""
    marker = marker or store.marker(step)
    saved = [store.manifest(step, r, marker) for r in range(marker["world_size"])]
    reader = _Reader(store, step, saved, marker)
    for path in paths:
        e = reader.holder(0, path)
        if e.global_shape is None:
            yield path, reader.tensor(0, path)
            continue
        whole = replace(e, path=path, shape=tuple(e.global_shape), global_offset=(0,) * len(e.global_shape))
        out = torch.empty(whole.shape, dtype=dtype_of(e.dtype))
        fill_sharded(out, whole, reader)
        yield path, out
