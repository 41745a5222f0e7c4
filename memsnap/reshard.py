"""Resharding: assemble one rank's snapshot for a new world size from the saved ranks' shards.

A step saved by W ranks is loaded by rank r of W' ranks like this: the live state's plan
(``capture.plan``) says which piece of every DTensor this rank now holds (global offset and
local shape); for each saved shard of that tensor (from the saved manifests' global offsets)
the overlapping box is computed, the saved shard's bytes are read from its rank file and
checked against its recorded checksum, and exactly the overlap is copied into a buffer laid out
like the live state. Replicated DTensors are read once (identical saved boxes are skipped);
plain tensors and the non-tensor leaves come from saved rank ``r % W``. The result is a
normal ``(Manifest, buffer)`` for ``apply.apply``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch

from memsnap.capture import plan
from memsnap.checksum import checksum
from memsnap.dtypes import dtype_of
from memsnap.errors import ChecksumError, FormatError, StateMismatchError
from memsnap.manifest import Manifest, TensorEntry, align_up
from memsnap.storage import Store, rank_name

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes in global coordinates, or None when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - s, o - s + n) for o, s, n in zip(box[0], origin, box[1]))


def _box(e: TensorEntry) -> Box:
    return tuple(e.global_offset or (0,) * len(e.shape)), tuple(e.shape)


class _Reader:
    """Reads saved tensors whole from their rank files, verifying each one's checksum."""

    def __init__(self, store: Store, step: int, saved: list[Manifest]):
        self.store, self.step, self.saved = store, step, saved

    def entry(self, rank: int, path: str) -> TensorEntry:
        try:
            return self.saved[rank].entry(path)
        except KeyError:
            raise FormatError(f"{self.store.path(self.step, rank_name(rank, 'json'))} has no tensor "
                              f"{path!r} although rank 0's manifest does; the step is damaged, load "
                              "another step") from None

    def holder(self, rank: int, path: str) -> TensorEntry:
        e = self.entry(rank, path)
        return self.entry(rank, e.alias_of) if e.alias_of else e

    def tensor(self, rank: int, path: str) -> torch.Tensor:
        e = self.holder(rank, path)
        out = torch.empty(e.nbytes, dtype=torch.uint8)
        self.store.read_range(self.step, rank, e.offset, out.numpy())
        if e.checksum is not None and checksum(out.numpy()) != e.checksum:
            raise ChecksumError(f"{self.store.path(self.step, rank_name(rank, 'bin'))} is corrupted: "
                                f"tensor {e.path!r} does not match its recorded checksum {e.checksum}")
        return out.view(dtype_of(e.dtype)).view(e.shape)


def _layout(template: Manifest, live: dict[str, TensorEntry]) -> list[TensorEntry]:
    out, offset, placed = [], 0, {}
    for e in template.tensors:
        want = live.get(e.path)
        if want is None and e.global_shape is not None:
            raise StateMismatchError(
                f"{e.path!r} is sharded in the checkpoint but absent from the live state; resharding "
                "needs every sharded tensor to exist (take one optimizer step before loading)")
        new = replace(e, checksum=None) if want is None else replace(
            e, shape=want.shape, global_offset=want.global_offset, placements=want.placements,
            mesh_shape=want.mesh_shape, checksum=None)
        if e.alias_of:
            out.append(replace(new, offset=placed[e.alias_of], nbytes=0))
            continue
        nbytes = dtype_of(new.dtype).itemsize * _numel(new.shape)
        out.append(replace(new, offset=offset, nbytes=nbytes))
        placed[e.path] = offset
        offset = align_up(offset + nbytes)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fill_sharded(dst: torch.Tensor, e: TensorEntry, reader: _Reader) -> None:
    saved_shape = tuple(reader.entry(0, e.path).global_shape or ())
    if tuple(e.global_shape) != saved_shape:
        raise StateMismatchError(f"{e.path!r}: live global shape {list(e.global_shape)} differs from the "
                                 f"checkpoint's {list(saved_shape)}")
    want, covered, seen = _box(e), 0, set()
    for rank in range(len(reader.saved)):
        src_box = _box(reader.holder(rank, e.path))
        box = overlap(want, src_box)
        if box is None or src_box in seen:
            continue
        seen.add(src_box)
        src = reader.tensor(rank, e.path)
        dst[_slices(box, want[0])] = src[_slices(box, src_box[0])]
        covered += _numel(box[1])
    if covered != _numel(want[1]):
        raise StateMismatchError(f"{e.path!r}: the saved shards cover {covered} of the {_numel(want[1])} "
                                 "elements this rank needs; the checkpoint's sharding is incomplete")


def assemble(store: Store, step: int, marker: dict, state: Mapping[str, Any], rank: int) -> tuple[Manifest, Any]:
    """Rank ``rank``'s manifest and buffer of ``step`` in the layout of the live ``state``."""
    world = marker["world_size"]
    saved = [store.manifest(step, r, marker) for r in range(world)]
    template = saved[rank % world]
    live = {e.path: e for e in plan(state).tensors}
    entries = _layout(template, live)
    nbytes = align_up(max((e.offset + e.nbytes for e in entries), default=0))
    base = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    reader = _Reader(store, step, saved)
    for e in entries:
        if e.alias_of or e.nbytes == 0:
            continue
        dst = base[e.offset:e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
        if e.global_shape is not None:
            _fill_sharded(dst, e, reader)
        else:
            dst.copy_(reader.tensor(rank % world, e.path))
    manifest = Manifest(entries, template.tree, nbytes, dict(template.meta))
    return manifest, base.numpy()[:nbytes]


def gather(store: Store, step: int, paths: list[str], marker: dict | None = None):
    """Yield ``(path, full tensor)`` for each path: DTensor shards from every saved rank joined
    into the global tensor, plain tensors from rank 0. Every shard read is checksum-verified."""
    marker = marker or store.marker(step)
    saved = [store.manifest(step, r, marker) for r in range(marker["world_size"])]
    reader = _Reader(store, step, saved)
    for path in paths:
        e = reader.holder(0, path)
        if e.global_shape is None:
            yield path, reader.tensor(0, path)
            continue
        whole = replace(e, path=path, shape=tuple(e.global_shape), global_offset=(0,) * len(e.global_shape))
        out = torch.empty(whole.shape, dtype=dtype_of(e.dtype))
        _fill_sharded(out, whole, reader)
        yield path, out
