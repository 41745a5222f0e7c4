"""Resharding: assemble one rank's snapshot for a new world size from the saved ranks' shards.

A step saved by W ranks is loaded by rank r of W' ranks like this: the live state's plan
(``capture.plan``) says which piece of every DTensor this rank now holds (global offset and
local shape); for each saved shard of that tensor (from the saved manifests' global offsets)
the overlapping box is computed and exactly the overlap is copied into a buffer laid out like
the live state, from a reader of the saved tensors (``durable.reshard`` reads the saved rank
files; ``coding.elastic`` the saved ranks' bytes in their peers' RAM).
The saved shards of a tensor must tile it exactly (no overlap, no gap), or the step is damaged.
Replicated DTensors are read once (identical saved boxes are skipped); plain tensors and the non-tensor leaves come from saved rank ``r % W``. The result is a
normal ``(Manifest, buffer)`` for ``apply.apply``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from memsnap.errors import FormatError, StateMismatchError
from memsnap.state import tree
from memsnap.state.dtypes import dtype_of
from memsnap.state.manifest import Manifest, TensorEntry, align_up

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes in global coordinates, or None when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(end <= start for start, end in zip(lo, hi)):
        return None
    return lo, tuple(end - start for start, end in zip(lo, hi))


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - s, o - s + n) for o, s, n in zip(box[0], origin, box[1]))


def _box(e: TensorEntry) -> Box:
    return tuple(e.global_offset or (0,) * len(e.shape)), tuple(e.shape)


def _layout(template: Manifest, live: dict[str, TensorEntry]) -> list[TensorEntry]:
    out: list[TensorEntry] = []
    offset = 0
    placed: dict[str, int] = {}
    for e in template.tensors:
        want = live.get(e.path)
        if want is None and e.global_shape is not None:
            raise StateMismatchError(
                f"{e.path!r} is sharded in the checkpoint but absent from the live state; resharding "
                "needs every sharded tensor to exist (take one optimizer step before loading)"
            )
        new = (
            replace(e, checksum=None)
            if want is None
            else replace(
                e,
                shape=want.shape,
                global_offset=want.global_offset,
                placements=want.placements,
                mesh_shape=want.mesh_shape,
                checksum=None,
            )
        )
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


def sources(e: TensorEntry, saved: list[Manifest], order=None) -> list[tuple[int, Box, Box]]:
    """Where the live shard ``e`` of a sharded tensor comes from: ``(saved rank, that rank's
    box, the overlap)`` for each saved shard that meets it, each distinct saved box once
    (replicated state is read from the first rank in ``order``, default 0..W-1, that has it).
    The saved shards must tile the tensor exactly (``tiling``)."""
    saved_shape = tiling(saved, e.path)
    assert e.global_shape is not None  # sources() is for sharded tensors
    if tuple(e.global_shape) != saved_shape:
        raise StateMismatchError(
            f"{e.path!r}: live global shape {list(e.global_shape)} differs from the checkpoint's {list(saved_shape)}"
        )
    want, seen, out = _box(e), set(), []
    for rank in range(len(saved)) if order is None else order:
        src_box = _box(_holder(saved, rank, e.path))
        box = overlap(want, src_box)
        if box is None or src_box in seen:
            continue
        seen.add(src_box)
        out.append((rank, src_box, box))
    return out


def tiling(saved: list[Manifest], path: str) -> tuple[int, ...]:
    """The global shape of the sharded tensor ``path``, after checking that every saved rank
    holds a shard of it of the same dtype and global shape and that the distinct saved shards
    tile it exactly: no two overlap and together they cover every element (``FormatError``
    otherwise: the step is damaged)."""
    first = _holder(saved, 0, path)
    whole = tuple(first.global_shape or ())
    boxes = set()
    for rank in range(len(saved)):
        e = _holder(saved, rank, path)
        if e.global_shape is None or tuple(e.global_shape) != whole or e.dtype != first.dtype:
            raise FormatError(
                f"{path!r}: saved rank {rank} holds it as {e.dtype} of global shape "
                f"{None if e.global_shape is None else list(e.global_shape)}, saved rank 0 "
                f"as {first.dtype} of {list(whole)}; the step is damaged, load another step"
            )
        if _numel(e.shape):
            boxes.add(_box(e))
    _disjoint(path, sorted(boxes))
    covered = sum(_numel(b[1]) for b in boxes)
    if covered != _numel(whole):
        raise FormatError(
            f"{path!r}: the saved shards cover {covered} of the {_numel(whole)} elements of "
            f"the global tensor {list(whole)}; the step is damaged, load another step"
        )
    return whole


def _disjoint(path: str, boxes: list[Box]) -> None:
    """No two of ``boxes`` overlap: a sweep along the dimension where they start at the most
    places (so row or column shards compare each box with its neighbours only)."""
    if len(boxes) < 2 or not boxes[0][0]:
        return
    ndim = len(boxes[0][0])
    d = max(range(ndim), key=lambda k: len({b[0][k] for b in boxes}))
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b[0][d]):
        active = [a for a in active if a[0][d] + a[1][d] > b[0][d]]
        for a in active:
            if overlap(a, b) is not None:
                raise FormatError(
                    f"{path!r}: saved shards {list(a[1])} at {list(a[0])} and {list(b[1])} at "
                    f"{list(b[0])} overlap; the step is damaged, load another step"
                )
        active.append(b)


def _holder(saved: list[Manifest], rank: int, path: str) -> TensorEntry:
    try:
        e = saved[rank].entry(path)
        return saved[rank].entry(e.alias_of) if e.alias_of else e
    except KeyError:
        raise FormatError(
            f"saved rank {rank}'s manifest has no tensor {path!r} although rank 0's does; "
            "the step is damaged, load another step"
        ) from None


def fill_sharded(dst: torch.Tensor, e: TensorEntry, reader) -> None:
    for rank, src_box, box in sources(e, reader.saved, getattr(reader, "order", None)):
        dst[_slices(box, e.global_offset or (0,) * len(e.shape))] = reader.tensor(rank, e.path)[
            _slices(box, src_box[0])
        ]


def _by_position(template: Manifest, live: Manifest) -> dict[str, TensorEntry]:
    """``{template entry path: live entry}`` for the tensors at the same skeleton position in
    both (matched by ``tree.tensor_names``, not by the stored entry names, which an older
    memsnap wrote ambiguously for some keys)."""
    at = {name: live.tensors[i] for i, name in tree.tensor_names(live.tree).items()}
    return {template.tensors[i].path: at[name] for i, name in tree.tensor_names(template.tree).items() if name in at}


def layout(saved: list[Manifest], live: Manifest, rank: int) -> Manifest:
    """Rank ``rank``'s manifest of the saved step in the layout of the ``live`` plan (no
    checksums, no bytes): which tensors it loads and where they sit in its buffer."""
    template = saved[rank % len(saved)]
    entries = _layout(template, _by_position(template, live))
    nbytes = align_up(max((e.offset + e.nbytes for e in entries), default=0))
    return Manifest(entries, template.tree, nbytes, dict(template.meta))


def reads(saved: list[Manifest], target: Manifest, rank: int, order=None) -> dict[int, list[str]]:
    """``{saved rank: [tensor paths]}``: every saved tensor rank ``rank`` reads to fill
    ``target`` (from ``layout``): the saved shards its DTensor shards overlap (a replicated
    one from the first saved rank in ``order``), and its plain tensors from saved rank
    ``rank % W``."""
    out: dict[int, list[str]] = {}
    for e in target.tensors:
        if e.alias_of or e.nbytes == 0:
            continue
        if e.global_shape is None:
            picks = [rank % len(saved)]
        else:
            picks = [r for r, _, _ in sources(e, saved, order)]
        for r in picks:
            held = _holder(saved, r, e.path).path
            if held not in out.setdefault(r, []):
                out[r].append(held)
    return out


def fill(target: Manifest, saved: list[Manifest], reader, rank: int) -> Any:
    """The buffer of ``target`` (from ``layout``), filled from ``reader.tensor(saved rank, path)``."""
    base = torch.empty(max(target.nbytes, 1), dtype=torch.uint8)
    for e in target.tensors:
        if e.alias_of or e.nbytes == 0:
            continue
        dst = base[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
        if e.global_shape is not None:
            fill_sharded(dst, e, reader)
        else:
            dst.copy_(reader.tensor(rank % len(saved), e.path))
    return base.numpy()[: target.nbytes]
