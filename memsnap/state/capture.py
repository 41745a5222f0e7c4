"""Capture: a dict of stateful objects -> a Manifest plus every tensor's bytes in one buffer.

The call sequence a snapshot takes (the training loop waits only for step 2):

1. ``plan(state)`` walks every ``state_dict()`` once and lays the tensors out, 64-byte
   aligned, in a ``Manifest`` (no tensor bytes are touched);
2. ``capture(state, out=buf, manifest=m)`` copies each tensor into ``buf`` (a reusable,
   caller-owned buffer: shared memory, pinned memory, a numpy array) with torch's ``copy_``;
3. ``fill_checksums(m, buf)`` hashes every tensor off the critical path.

Objects with ``state_dict()``/``load_state_dict()`` are captured through their state dicts;
any other value (tensors, numbers, strings, nested containers) is captured as is. RNG state
goes under the reserved key ``"__rng__"``. Tied tensors (same storage, same view) are stored
once; later occurrences get ``alias_of`` and no bytes. DTensors store their local shard and
record their place in the global tensor.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from memsnap.errors import SnapshotBufferError, StateMismatchError, UnsupportedStateError
from memsnap.state import rng as rng_state
from memsnap.state import tree
from memsnap.state.checksum import checksum, fill_checksums  # noqa: F401 (re-exported)
from memsnap.state.dtypes import NAME_OF, dtype_name
from memsnap.state.manifest import Manifest, TensorEntry, align_up, compact_json

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

RNG_KEY = "__rng__"

if sys.byteorder != "little":  # the snapshot format is little-endian raw storage
    raise ImportError("memsnap snapshots are little-endian; this host is big-endian")


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is captured through ``state_dict()`` / ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def collect(state: Mapping[str, Any], *, rng: bool = True) -> dict[str, Any]:
    """The plain nested value a snapshot stores: each object's state dict, plus RNG state."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(f"state must be a dict of named objects, got {type(state).__qualname__}")
    bad = [k for k in state if type(k) is not str or k == RNG_KEY]
    if bad:
        raise StateMismatchError(
            f"state keys must be strings other than {RNG_KEY!r} (reserved for RNG state); got {bad[0]!r}"
        )
    values = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
    if rng:
        values[RNG_KEY] = rng_state.get_state()
    return values


# --- sharded tensors -------------------------------------------------------------------------
def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def placement_name(p: Any) -> str:
    kind = type(p).__name__
    if kind == "Shard":
        return f"Shard({p.dim})"
    if kind == "Replicate":
        return "Replicate()"
    if kind == "Partial":
        return f"Partial({p.reduce_op})"
    return repr(p)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes a snapshot stores: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def _sharding(t: torch.Tensor) -> dict[str, Any]:
    if not is_dtensor(t):
        return {}
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {
        "global_shape": tuple(t.shape),
        "global_offset": tuple(int(o) for o in offset),
        "placements": tuple(placement_name(p) for p in t.placements),
        "mesh_shape": tuple(t.device_mesh.shape),
    }


# --- planning --------------------------------------------------------------------------------
def _walk(values: dict[str, Any]) -> tuple[Any, list[str], list[torch.Tensor]]:
    """The skeleton, plus every tensor (as found: DTensors stay DTensors) and its name (its
    position in the skeleton, ``tree.segment``); tensors that hold no plain bytes are refused."""
    paths: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: set[str] = set()

    def on_tensor(t: torch.Tensor, path: str) -> int:
        check_storable(local_tensor(t), path)
        if path in seen:  # only keys that differ yet write out alike (two nan keys) get here
            raise UnsupportedStateError(
                f"two tensors of the state are both named {path!r}: their dict keys differ but are "
                "written out alike (e.g. two nan keys); give the keys distinct values"
            )
        seen.add(path)
        paths.append(path)
        tensors.append(t)
        return len(tensors) - 1

    return tree.encode(values, on_tensor), paths, tensors


def check_storable(t: torch.Tensor, path: str) -> None:
    """Refuse a tensor a snapshot cannot copy bytes from: not dense, or on the meta device."""
    if t.layout is not torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise UnsupportedStateError(
            f"tensor at {path!r} is a {kind} tensor, which a snapshot cannot store; store t.to_dense() "
            "(or its parts, e.g. indices() and values(), as separate tensors)"
        )
    if t.is_meta:
        raise UnsupportedStateError(
            f"tensor at {path!r} is on the meta device and holds no data; materialise it before saving "
            "(e.g. model.to_empty(device='cpu'), then initialise or load it)"
        )


def _alias_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _layout(paths: list[str], found: list[torch.Tensor]) -> tuple[list[TensorEntry], int]:
    entries: list[TensorEntry] = []
    first: dict[tuple, TensorEntry] = {}
    offset = 0
    for path, whole in zip(paths, found):
        t = local_tensor(whole)
        key = _alias_key(t)
        common = dict(
            path=path, dtype=dtype_name(t.dtype), shape=tuple(t.shape), device=str(t.device), **_sharding(whole)
        )
        if key is not None and key in first:
            held = first[key]
            entries.append(TensorEntry(offset=held.offset, nbytes=0, alias_of=held.path, **common))
            continue
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(offset=offset, nbytes=nbytes, **common))
        if key is not None:
            first[key] = entries[-1]
        offset = align_up(offset + nbytes)
    return entries, offset


def plan(state: Mapping[str, Any], *, rng: bool = True) -> Manifest:
    """The layout of ``state`` (offsets, dtypes, shapes, skeleton) without copying tensor bytes."""
    return plan_sources(state, rng=rng)[0]


def plan_sources(state: Mapping[str, Any], *, rng: bool = True) -> tuple[Manifest, list[torch.Tensor]]:
    """The layout of ``state`` and, in manifest order, the (local) tensors whose bytes it
    places: what ``copy_into`` (or an asynchronous copier) needs, from one walk of the state."""
    skeleton, paths, found = _walk(collect(state, rng=rng))
    entries, nbytes = _layout(paths, found)
    sources = [local_tensor(t).detach() for t in found]
    return Manifest(tensors=entries, tree=skeleton, nbytes=nbytes), sources


class PlanCache:
    """One rank's layout kept from save to save until its tensors change: a save then walks
    the state only for its non-tensor leaves (LR, step counts, RNG: the skeleton), checks
    each tensor against the kept layout (a few attribute reads), and reuses the layout's JSON.
    ``replans`` counts the saves that had to lay the state out again."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._entries: list[TensorEntry] = []
        self._nbytes = 0
        self._json: str | None = None
        self.replans = 0

    def plan(self, state: Mapping[str, Any], *, rng: bool = True) -> tuple[Manifest, list[torch.Tensor]]:
        """What ``plan_sources`` returns, from the kept layout when it still fits."""
        skeleton, paths, found = _walk(collect(state, rng=rng))
        locals_ = [local_tensor(t) for t in found]
        key = _fingerprint(paths, found, locals_)
        if key != self._key:
            self._entries, self._nbytes = _layout(paths, found)
            self._json = compact_json([e.to_dict() for e in self._entries])
            self._key = key
            self.replans += 1
        manifest = Manifest(tensors=self._entries, tree=skeleton, nbytes=self._nbytes, tensors_json=self._json)
        return manifest, [t.detach() for t in locals_]


def _fingerprint(paths: list[str], found: list[torch.Tensor], locals_: list[torch.Tensor]) -> tuple:
    """Everything the layout of these tensors depends on: paths, dtypes, shapes, devices,
    which tensors are tied (not where they live: the RNG state is a new tensor every time),
    and a sharded tensor's global shape and placements."""
    first: dict[tuple, int] = {}
    tied = []
    for i, t in enumerate(locals_):
        key = _alias_key(t)
        tied.append(-1 if key is None else first.setdefault(key, i))
    return (
        tuple(paths),
        tuple((t.dtype, t.shape, t.device) for t in locals_),
        tuple(tied),
        tuple((tuple(w.shape), tuple(map(placement_name, w.placements))) for w in found if is_dtensor(w)),
    )


def _refuse(path: str, t: torch.Tensor | None, was: TensorEntry | None) -> StateMismatchError:
    now = "absent" if t is None else f"{dtype_name(t.dtype)}{list(t.shape)}"
    old = "absent" if was is None else f"{was.path!r} as {was.dtype}{list(was.shape)}"
    return StateMismatchError(
        f"tensor {path!r} is {now} but the reused manifest has {old}; call capture() without manifest= to re-plan"
    )


def _check_fits(paths: list[str], locals_: list[torch.Tensor], old: Manifest) -> None:
    """Cheaply check that ``old``'s layout still fits the tensors found now (per tensor: a few
    attribute reads, no new objects) and that tied tensors are still tied."""
    entries = old.tensors
    for i, (path, t) in enumerate(zip(paths, locals_)):
        was = entries[i] if i < len(entries) else None
        if was is None or was.path != path or was.shape != t.shape or was.dtype != NAME_OF.get(t.dtype):
            raise _refuse(path, t, was)
    if len(entries) != len(paths):
        raise _refuse(entries[len(paths)].path, None, entries[len(paths)])
    index = None
    for i, was in enumerate(entries):
        if was.alias_of is not None:
            index = index or {e.path: j for j, e in enumerate(entries)}
            if locals_[i].data_ptr() != locals_[index[was.alias_of]].data_ptr():
                raise StateMismatchError(
                    f"tensor {was.path!r} is no longer tied to {was.alias_of!r}; "
                    f"call capture() without manifest= to re-plan"
                )


def _reuse(skeleton: Any, paths: list[str], locals_: list[torch.Tensor], old: Manifest) -> Manifest:
    """``old``'s layout with the new skeleton, after checking the tensors did not change."""
    _check_fits(paths, locals_, old)
    entries = old.tensors
    if any(e.checksum is not None for e in entries):
        entries = [replace(e, checksum=None) for e in entries]
    return replace(old, tensors=entries, tree=skeleton, tensors_json=None)


# --- copying ---------------------------------------------------------------------------------
def snapshot_view(buf: Any, nbytes: int, *, writable: bool) -> memoryview:
    """A snapshot buffer ``buf`` as a flat memoryview of exactly ``nbytes`` bytes, checked for
    size and access, with errors that name the buffer (``buffers.byte_view`` is the unchecked
    view of the data plane)."""
    try:
        mv = memoryview(buf).cast("B")
    except (TypeError, ValueError) as exc:
        raise SnapshotBufferError(
            f"buffer of type {type(buf).__qualname__} is not a contiguous byte buffer: {exc}"
        ) from None
    if writable and mv.readonly:
        raise SnapshotBufferError(f"capture needs a writable buffer; {type(buf).__qualname__} is read-only")
    if mv.nbytes < nbytes:
        raise SnapshotBufferError(
            f"buffer holds {mv.nbytes} bytes but the snapshot needs {nbytes}; allocate at least manifest.nbytes"
        )
    return mv[:nbytes]


def tensor_bytes(t: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """The first ``nbytes`` (default: all) bytes of contiguous CPU tensor ``t``'s memory,
    writable, without a copy (any dtype, bfloat16 included); the caller keeps ``t`` alive."""
    n = t.numel() * t.element_size() if nbytes is None else nbytes
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def tensor_view(base: torch.Tensor, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """The slice of the uint8 tensor ``base`` that holds ``entry``, typed and shaped."""
    return base[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)


def _new_buffer(nbytes: int, sources: list[torch.Tensor]) -> memoryview:
    pinned = any(t.is_cuda for t in sources) and torch.cuda.is_available()
    arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
    return memoryview(arena.numpy())[:nbytes]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12


def copy_into(manifest: Manifest, sources: list[torch.Tensor], out: memoryview) -> None:
    """Copy every stored tensor's bytes to its offset in ``out`` (D2H for CUDA tensors)."""
    if manifest.nbytes == 0:
        return
    flat = np.frombuffer(out, dtype=np.uint8, count=manifest.nbytes)
    base, address = torch.from_numpy(flat), flat.ctypes.data
    cuda = False
    for entry, src in zip(manifest.tensors, sources):
        if entry.alias_of is not None or not entry.nbytes:
            continue
        end = entry.offset + entry.nbytes
        ctypes.memset(address + end, 0, align_up(end) - end)  # padding: zeros, never stale memory
        if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
            # one plain memcpy (GIL released): torch's copy_ splits big copies over threads,
            # which loses to a single memcpy when the cores are busy with the training job
            ctypes.memmove(address + entry.offset, src.data_ptr(), entry.nbytes)
        else:
            cuda |= src.is_cuda
            tensor_view(base, entry, src.dtype).copy_(src, non_blocking=src.is_cuda)
    if cuda:
        torch.cuda.synchronize()


def capture(
    state: Mapping[str, Any],
    *,
    out: Any = None,
    rng: bool = True,
    checksums: bool = False,
    manifest: Manifest | None = None,
) -> tuple[Manifest, memoryview]:
    """Copy ``state`` into ``out`` (or a new buffer); return its manifest and exactly its bytes."""
    skeleton, paths, found = _walk(collect(state, rng=rng))
    sources = [local_tensor(t).detach() for t in found]
    if manifest is None:
        entries, nbytes = _layout(paths, found)
        m = Manifest(tensors=entries, tree=skeleton, nbytes=nbytes)
    else:
        m = _reuse(skeleton, paths, sources, manifest)
    mv = _new_buffer(m.nbytes, sources) if out is None else snapshot_view(out, m.nbytes, writable=True)
    copy_into(m, sources, mv)
    return (fill_checksums(m, mv) if checksums else m), mv
