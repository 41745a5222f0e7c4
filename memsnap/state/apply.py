"""Apply: a Manifest plus its bytes -> back into the live objects, in place, all or nothing.

Sequence: (1) validate the manifest (``memsnap.state.validate``: ``FormatError``), match the
snapshot against the live state (top-level keys, every tensor's path, dtype and shape,
optimizer parameter groups: ``plan``; ``StateMismatchError``) and check the buffer, all
before anything is touched; (2) with ``verify``, check every checksum;
(3) copy the bytes into the live tensors (same device, same dtype; a DTensor's local shard)
and call each object's ``load_state_dict``; plain values are written back into ``state``;
(4) restore RNGs. ``memsnap.coding.receive`` runs (1) (``plan``), receives the bytes into the tensors
itself, then (3) and (4) (``finish``).

Tensors the snapshot has and the live object lacks (e.g. optimizer moments before the first
step) are handed to ``load_state_dict`` as new CPU tensors, which it places itself.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from memsnap.errors import ChecksumError, FormatError, SnapshotBufferError, StateMismatchError
from memsnap.state import rng as rng_state
from memsnap.state import tree, validate
from memsnap.state.capture import RNG_KEY, is_dtensor, is_stateful, local_tensor, snapshot_view, tensor_view
from memsnap.state.checksum import checksum
from memsnap.state.dtypes import dtype_name, dtype_of
from memsnap.state.manifest import Manifest, TensorEntry


def verify_checksums(manifest: Manifest, mv: memoryview) -> None:
    """Raise ``ChecksumError`` naming the first tensor whose bytes do not match (unhashed: skipped)."""
    for t in manifest.tensors:
        if t.checksum is None or t.alias_of:
            continue
        got = checksum(mv[t.offset : t.offset + t.nbytes])
        if got != t.checksum:
            raise ChecksumError(
                f"tensor {t.path!r} (bytes {t.offset}..{t.offset + t.nbytes}) hashes to {got} but the "
                f"manifest records {t.checksum}; the snapshot copy is corrupt, restore from another copy"
            )


def _live_tensors(value: Any, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of the live value of state key ``key``, by its name (``tree.segment``)."""
    found: dict[str, torch.Tensor] = {}

    def on_tensor(t: torch.Tensor, path: str) -> int:
        if path in found:
            raise StateMismatchError(
                f"two live tensors are both named {path!r}: their dict keys differ but are written "
                "out alike (e.g. two nan keys); give the keys distinct values"
            )
        found[path] = t
        return 0

    tree.encode(value, on_tensor, tree.segment(key))
    return found


def _saved_tensors(subtree: Any, key: str) -> dict[str, int]:
    """Every tensor of the snapshot's value of state key ``key``: name -> manifest index."""
    found: dict[str, int] = {}

    def tensor_at(i: int, path: str) -> None:
        if path in found:
            raise FormatError(
                f"the snapshot names two tensors {path!r}; the manifest is damaged or was "
                "written from keys that differ but write out alike (two nan keys)"
            )
        found[path] = i

    tree.decode(subtree, tensor_at, tree.segment(key))
    return found


@dataclass
class _ObjectPlan:
    """What applying one top-level key will do, decided before anything is mutated."""

    key: str
    obj: Any
    subtree: Any
    live: dict[str, torch.Tensor]


def _describe(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def _check_tensor(path: str, entry: TensorEntry, live: torch.Tensor) -> None:
    local = local_tensor(live)
    if (dtype_name(local.dtype), tuple(local.shape)) != (entry.dtype, entry.shape):
        raise StateMismatchError(
            f"{path!r}: snapshot has {entry.dtype}{list(entry.shape)}, live state has {_describe(local)}"
        )
    if entry.global_shape is not None and is_dtensor(live) and tuple(live.shape) != entry.global_shape:
        raise StateMismatchError(
            f"{path!r}: snapshot shard is of a global tensor {list(entry.global_shape)}, live DTensor is "
            f"{list(live.shape)}; resharding is not done by apply"
        )
    _check_destination(path, local)


def _check_destination(path: str, t: torch.Tensor) -> None:
    """Refuse a live tensor the snapshot's bytes cannot be written into in place, before any
    tensor is written (so a refused apply leaves every tensor as it was)."""
    if t.is_meta:
        raise StateMismatchError(
            f"{path!r} is on the meta device (deferred init) and cannot receive the snapshot's bytes; "
            "materialise the model first, e.g. model.to_empty(device='cpu'), then restore"
        )
    if t.layout is not torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise StateMismatchError(
            f"{path!r}: the live tensor is a {kind} tensor, which a snapshot's dense "
            "bytes cannot be written into; make it dense before restoring"
        )
    if t.numel() > 1 and any(stride == 0 and n > 1 for n, stride in zip(t.shape, t.stride())):
        raise StateMismatchError(
            f"{path!r}: elements of the live tensor share memory (shape {list(t.shape)}, stride "
            f"{list(t.stride())}, e.g. made by expand()), so it cannot be written in place; give it "
            "its own memory (t.clone()) before restoring"
        )


def _check_keys(path_kind: str, missing: list[str], extra: list[str]) -> None:
    if missing:
        raise StateMismatchError(
            f"{path_kind} {missing[0]!r} is in the live state but not in the snapshot "
            f"({len(missing)} missing in all); pass strict=False to leave such keys as they are"
        )
    if extra:
        raise StateMismatchError(
            f"{path_kind} {extra[0]!r} is in the snapshot but not in the live state "
            f"({len(extra)} extra in all); pass strict=False to ignore them"
        )


def _group_sizes(sd: Any) -> list[int] | None:
    """How many parameters each group of an optimizer state dict holds (None: malformed)."""
    groups = sd.get("param_groups") if isinstance(sd, dict) and isinstance(sd.get("state"), dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("params"), list)
        and all(isinstance(i, (int, str)) for i in g["params"])
        for g in groups
    ):
        return None
    return [len(g["params"]) for g in groups]


def _check_param_groups(key: str, live: Any, saved: Any) -> None:
    sizes = _group_sizes(saved)
    if sizes is None:
        raise FormatError(
            f"{key!r}: the snapshot's optimizer state dict has no well-formed 'state' and "
            "'param_groups' (lists of parameter ids); the manifest is damaged"
        )
    if _group_sizes(live) != sizes:
        raise StateMismatchError(
            f"{key!r}: snapshot optimizer has parameter groups of sizes {sizes}, live optimizer "
            f"has {_group_sizes(live)}; build the optimizer over the same parameters before applying"
        )


def _parse_placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    kind, _, arg = text.partition("(")
    arg = arg.rstrip(")")
    if kind == "Shard":
        return Shard(int(arg))
    if kind == "Replicate":
        return Replicate()
    if kind == "Partial":
        return Partial(arg or "sum")
    raise StateMismatchError(f"unknown DTensor placement {text!r} in the manifest")


def _live_meshes(state: Mapping[str, Any], plans: list[_ObjectPlan]) -> list[Any]:
    """Every device mesh a live DTensor of the state sits on (params of optimizers included)."""
    tensors = [t for p in plans for t in p.live.values()]
    for obj in state.values():
        for group in getattr(obj, "param_groups", None) or []:
            tensors.extend(group.get("params", []))
    meshes: list[Any] = []  # DeviceMesh objects
    for t in tensors:
        mesh = getattr(t, "device_mesh", None) if is_dtensor(t) else None
        if mesh is not None and all(mesh is not m for m in meshes):
            meshes.append(mesh)
    return meshes


def _mesh_for(entry: TensorEntry, meshes: list[Any]) -> Any:
    for mesh in meshes:
        if tuple(mesh.shape) == entry.mesh_shape:
            return mesh
    raise StateMismatchError(
        f"{entry.path!r} is a DTensor on a mesh of shape {list(entry.mesh_shape or ())} but no live "
        f"DTensor sits on such a mesh ({[list(m.shape) for m in meshes]}); shard the model before applying"
    )


def _plan_object(key: str, obj: Any, subtree: Any, manifest: Manifest, strict: bool) -> _ObjectPlan:
    live_value = obj.state_dict() if is_stateful(obj) else obj
    live = _live_tensors(live_value, key)
    saved = _saved_tensors(subtree, key)
    for path, i in saved.items():
        if path in live:
            _check_tensor(path, manifest.tensors[i], live[path])
    if strict:
        extra = [p for p in saved if p not in live] if isinstance(obj, torch.nn.Module) else []
        _check_keys("tensor", [p for p in live if p not in saved], extra)
    if isinstance(obj, torch.optim.Optimizer):
        _check_param_groups(key, live_value, tree.decode(subtree, lambda i, p: None))
    return _ObjectPlan(key, obj, subtree, live)


def _as_sharded(entry: TensorEntry, local: torch.Tensor, meshes: list[Any]) -> torch.Tensor:
    if not entry.placements:
        return local
    from torch.distributed.tensor import DTensor

    mesh = _mesh_for(entry, meshes)
    if mesh.device_type != "cpu":
        local = local.to(mesh.device_type)
    placements = [_parse_placement(p) for p in entry.placements]
    assert entry.global_shape is not None  # an entry with placements is sharded
    shape = torch.Size(entry.global_shape)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
    )


def _check_span(e: TensorEntry, size: int, dst: torch.Tensor) -> None:
    """Defence in depth before the raw copy (``plan`` validated the layout already)."""
    if not (0 <= e.offset and e.offset + e.nbytes <= size and dst.numel() * dst.element_size() == e.nbytes):
        raise SnapshotBufferError(
            f"refusing to copy {e.path!r}: {e.nbytes} bytes at offset {e.offset} of a {size}-byte buffer "
            f"into a {dst.numel() * dst.element_size()}-byte tensor; the manifest does not match its buffer"
        )


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` outside autograd: a live leaf that requires grad (or a view of one) is
    written in place like any other tensor, an inference tensor inside inference mode."""
    with torch.inference_mode() if dst.is_inference() else torch.no_grad():
        dst.copy_(src)


class _Source:
    """Typed views of the snapshot bytes, following aliases to the entry that holds them."""

    def __init__(self, manifest: Manifest, mv: memoryview, meshes: list[Any]):
        self.manifest, self.meshes = manifest, meshes
        self.index = {t.path: i for i, t in enumerate(manifest.tensors)}
        self.base: torch.Tensor | None = None
        self.address, self.size = 0, mv.nbytes
        if manifest.nbytes:
            with warnings.catch_warnings():  # read-only snapshot bytes are only ever read
                warnings.simplefilter("ignore", UserWarning)
                self.base = torch.frombuffer(mv, dtype=torch.uint8)
            self.address = self.base.data_ptr()
        self.fresh: dict[int, torch.Tensor] = {}

    def copy_into(self, i: int, dst: torch.Tensor) -> None:
        """Copy entry ``i``'s bytes into the live tensor ``dst`` (checked to match beforehand)."""
        e = self.manifest.tensors[self.holder(i)]
        if dst.device.type == "cpu" and dst.is_contiguous() and not (dst.is_conj() or dst.is_neg()) and e.nbytes:
            _check_span(e, self.size, dst)
            ctypes.memmove(dst.data_ptr(), self.address + e.offset, e.nbytes)  # one plain memcpy
        else:
            _write(dst, self.view(i))

    def holder(self, i: int) -> int:
        alias = self.manifest.tensors[i].alias_of
        return i if alias is None else self.index[alias]

    def view(self, i: int) -> torch.Tensor:
        e = self.manifest.tensors[self.holder(i)]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype_of(e.dtype))
        assert self.base is not None  # bytes to view: the manifest has some
        return tensor_view(self.base, e, dtype_of(e.dtype))

    def new_tensor(self, i: int) -> torch.Tensor:
        h = self.holder(i)
        if h not in self.fresh:  # tied tensors the live state lacks come back tied
            self.fresh[h] = _as_sharded(self.manifest.tensors[i], self.view(h).clone(), self.meshes)
        return self.fresh[h]


class _Received(_Source):
    """The snapshot's tensors already received one by one (``received``: entry index ->
    tensor): into the live tensors themselves (``live``: those indices), or into new CPU
    tensors that ``load_state_dict`` adopts without another copy."""

    def __init__(self, manifest: Manifest, received: dict[int, torch.Tensor], live: set[int], meshes: list[Any]):
        self.manifest, self.meshes = manifest, meshes
        self.index = {t.path: i for i, t in enumerate(manifest.tensors)}
        self.received, self.live = received, live
        self.fresh = {}

    def copy_into(self, i: int, dst: torch.Tensor) -> None:
        h = self.holder(i)
        src = self.received.get(h)
        if src is not None and h in self.live and src.data_ptr() == dst.data_ptr():
            return  # received in place
        _write(dst, self.view(i))

    def view(self, i: int) -> torch.Tensor:
        h = self.holder(i)
        e = self.manifest.tensors[h]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype_of(e.dtype))
        return self.received[h]

    def new_tensor(self, i: int) -> torch.Tensor:
        h = self.holder(i)
        if h not in self.fresh:  # a tensor received into live memory is not handed out twice
            t = self.view(h)
            self.fresh[h] = _as_sharded(self.manifest.tensors[i], t.clone() if h in self.live else t, self.meshes)
        return self.fresh[h]


def _run(p: _ObjectPlan, src: _Source, state: Any, strict: bool) -> None:
    def tensor_at(i: int, path: str) -> torch.Tensor:
        live = p.live.get(path)
        if live is None:
            return src.new_tensor(i)
        src.copy_into(i, local_tensor(live))
        return live

    value = tree.decode(p.subtree, tensor_at, tree.segment(p.key))
    if not is_stateful(p.obj):
        if not isinstance(p.obj, torch.Tensor):
            state[p.key] = value
        return
    try:
        if isinstance(p.obj, torch.nn.Module):
            p.obj.load_state_dict(value, strict=strict)
        else:
            p.obj.load_state_dict(value)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        raise StateMismatchError(
            f"{p.key!r}: load_state_dict refused the snapshot's value "
            f"({type(exc).__name__}: {exc}); the state is partly restored, "
            "load it again from an intact snapshot"
        ) from exc


def _top_level(manifest: Manifest) -> dict[str, Any]:
    top = manifest.tree
    if not isinstance(top, dict) or (len(top) == 1 and next(iter(top)) in tree.TAGS):
        raise StateMismatchError("manifest tree is not a dict of named objects; it was not written by capture()")
    return top


def _damaged_rng(exc: ValueError, what: str) -> FormatError:
    return FormatError(
        f"the snapshot's RNG state ({RNG_KEY!r}) {exc}; the {what} is damaged "
        "(pass rng=False to apply without restoring RNGs)"
    )


def _check_rng(saved: Any, manifest: Manifest) -> None:
    # manifest entries stand in for the tensors
    value = tree.decode(saved, lambda i, p: manifest.tensors[i], tree.segment(RNG_KEY))
    try:
        rng_state.check_state(value, lambda e: isinstance(e, TensorEntry) and e.dtype == "uint8" and len(e.shape) == 1)
    except ValueError as exc:
        raise _damaged_rng(exc, "manifest") from None
    want = torch.get_rng_state().numel()
    if value["torch"].shape != (want,):
        raise StateMismatchError(
            f"snapshot RNG state does not hold a torch CPU generator state of {want} bytes; "
            f"pass rng=False to apply without restoring RNGs"
        )


@dataclass
class Plan:
    """Everything ``apply`` checked about ``state`` against a manifest, before any byte moves:
    built by ``plan``, carried out by ``finish``."""

    manifest: Manifest
    objects: list[_ObjectPlan]
    saved_rng: Any
    meshes: list[Any]
    rng: bool
    strict: bool

    def tensor_entries(self):
        """``(entry index, live tensor or None)`` for every tensor the apply will write,
        RNG states included (they have no live tensor)."""
        for p in self.objects:
            for path, i in _saved_tensors(p.subtree, p.key).items():
                yield i, p.live.get(path)
        if self.rng and self.saved_rng is not None:
            for i in _saved_tensors(self.saved_rng, RNG_KEY).values():
                yield i, None


def plan(state: Mapping[str, Any], manifest: Manifest, *, rng: bool = True, strict: bool = True) -> Plan:
    """Match the snapshot against the live state; raise ``StateMismatchError`` on any mismatch.

    Nothing is touched: everything that can be refused is refused here (a malformed manifest
    with ``FormatError``)."""
    validate.manifest(manifest)
    saved = dict(_top_level(manifest))
    saved_rng = saved.pop(RNG_KEY, None)
    if strict:
        _check_keys("state key", [k for k in state if k not in saved], [k for k in saved if k not in state])
    plans = [_plan_object(k, state[k], saved[k], manifest, strict) for k in saved if k in state]
    if any(not is_stateful(p.obj) and not isinstance(p.obj, torch.Tensor) for p in plans) and not isinstance(
        state, MutableMapping
    ):
        raise StateMismatchError("state holds plain values but is read-only; pass a dict so they can be restored")
    if rng and saved_rng is not None:
        _check_rng(saved_rng, manifest)
    meshes = _live_meshes(state, plans)
    for p in plans:
        for path, i in _saved_tensors(p.subtree, p.key).items():
            if path not in p.live and manifest.tensors[i].placements:
                _mesh_for(manifest.tensors[i], meshes)
    return Plan(manifest, plans, saved_rng, meshes, rng, strict)


def finish(pl: Plan, src: _Source, state: Any) -> None:
    """Write the snapshot's values from ``src`` into ``state`` as ``pl`` decided."""
    saved_rng = None
    if pl.rng and pl.saved_rng is not None:
        saved_rng = tree.decode(pl.saved_rng, lambda i, p: src.new_tensor(i), tree.segment(RNG_KEY))
        try:
            rng_state.check_generator_bytes(saved_rng)
        except ValueError as exc:
            raise _damaged_rng(exc, "snapshot") from None
    for p in pl.objects:
        _run(p, src, state, pl.strict)
    if saved_rng is not None:
        rng_state.set_state(saved_rng)


def apply(
    state: Mapping[str, Any],
    manifest: Manifest,
    buf: Any,
    *,
    rng: bool = True,
    verify: bool = True,
    strict: bool = True,
) -> None:
    """Put the snapshot ``manifest`` + ``buf`` back into ``state``; validate everything first."""
    pl = plan(state, manifest, rng=rng, strict=strict)
    if verify:
        verify_checksums(manifest, snapshot_view(buf, manifest.nbytes, writable=False))
    apply_plan(state, pl, buf)


def apply_plan(state: Mapping[str, Any], pl: Plan, buf: Any) -> None:
    """Carry out ``pl`` (from ``plan``) with the snapshot bytes ``buf``."""
    mv = snapshot_view(buf, pl.manifest.nbytes, writable=False)
    finish(pl, _Source(pl.manifest, mv, pl.meshes), state)


def _in_place(t: torch.Tensor | None) -> bool:
    return (
        t is not None
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
        and t.numel() > 0
    )


def destinations(pl: Plan) -> tuple[dict[int, torch.Tensor], set[int]]:
    """``(received, live)``: the tensor each stored entry of the snapshot is received into
    (``memsnap.coding.receive``, a live takeover), and which of those are live tensors of the
    state (the rest are new: where the live one is missing, not on the CPU or not contiguous)."""
    man = pl.manifest
    want: dict[int, torch.Tensor | None] = {}
    for i, live in pl.tensor_entries():
        e = man.tensors[i]
        if not e.alias_of and e.nbytes and i not in want:
            t = None if live is None else local_tensor(live)
            want[i] = t if _in_place(t) else None
    spans, ends = sorted((t.data_ptr(), i) for i, t in want.items() if t is not None), 0
    for ptr, i in spans:  # two entries on one live storage (tied live, untied saved): one is new
        if ptr < ends:
            want[i] = None
        else:
            ends = ptr + man.tensors[i].nbytes
    received = {
        i: t if t is not None else torch.empty(man.tensors[i].shape, dtype=dtype_of(man.tensors[i].dtype))
        for i, t in want.items()
    }
    return received, {i for i, t in want.items() if t is not None}


def apply_received(state: Mapping[str, Any], pl: Plan, received: dict[int, torch.Tensor], live: set[int]) -> None:
    """Finish ``pl`` from tensors received one by one (see ``memsnap.coding.receive``)."""
    finish(pl, _Received(pl.manifest, received, live, pl.meshes), state)


def rng_of_entries(manifest: Manifest, tensor: Any) -> dict[str, Any] | None:
    """The RNG states a snapshot holds (what ``rng.set_state`` takes), or None; ``tensor(i)``
    gives entry ``i``'s tensor (a live takeover receives its bytes apart)."""
    saved = _top_level(manifest).get(RNG_KEY)
    if saved is None:
        return None
    value = tree.decode(saved, lambda i, p: tensor(i), tree.segment(RNG_KEY))
    try:
        rng_state.check_generator_bytes(value)
    except ValueError as exc:
        raise _damaged_rng(exc, "snapshot") from None
    return value
