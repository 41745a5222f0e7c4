"""The manifest: everything about a snapshot except its tensor bytes, as JSON.

A snapshot is a ``Manifest`` plus one flat byte buffer. The manifest lists every tensor
(where its bytes sit in the buffer, its dtype, shape, checksum and, for sharded tensors, its
place in the global tensor) and keeps the non-tensor leaves of the state inline in ``tree``.
Everything downstream of capture (codec, transport, agent store, spill) sees only these two
things. Nothing here is pickled: ``to_json``/``from_json`` are the only serialisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

from memsnap.state import validate

FORMAT_VERSION = 1
ALIGN = validate.ALIGN  # every tensor starts on a cache-line boundary of the buffer


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the snapshot.

    ``path`` names the tensor by its position in the state, one name per position (the keys
    joined by ``/``, written by ``tree.segment``: ``"model/fc1.weight"``, ``"optim/state/0/exp_avg"``,
    a string key ``"a/b"`` as ``"a%2Fb"``, ``"0"`` as ``"%30"``).
    ``offset``/``nbytes`` locate its bytes in the snapshot buffer; ``alias_of`` is set (and
    ``nbytes`` is 0) for a tensor that shares storage with an earlier one (tied weights).
    ``checksum`` is the xxh3-64 of its bytes as 16 hex digits, or None until computed.
    For a sharded tensor (DTensor), ``global_shape`` is the whole tensor's shape,
    ``global_offset`` this shard's start along every dimension, ``placements`` the DTensor
    placements as strings (``"Shard(0)"``, ``"Replicate()"``) and ``mesh_shape`` the device
    mesh it lived on.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str | None = None
    device: str = "cpu"
    alias_of: str | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    placements: tuple[str, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in _ENTRY_FIELDS:
            v = getattr(self, name)
            if v is not None:
                out[name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorEntry:
        d = dict(d)
        for k in ("shape", "global_shape", "global_offset", "placements", "mesh_shape"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


_ENTRY_FIELDS = tuple(f.name for f in fields(TensorEntry))


@dataclass
class Manifest:
    """The layout of one rank's snapshot.

    ``tree`` is the JSON skeleton of the captured state; a tensor leaf appears in it as
    ``{"__tensor__": i}`` where ``i`` indexes ``tensors``. ``nbytes`` is the size of the
    buffer the tensors are packed into (aligned to ``ALIGN``). ``meta`` holds free-form JSON
    (step, rank, world size, versions, user metadata).
    """

    tensors: list[TensorEntry]
    tree: Any
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    tensors_json: str | None = field(default=None, repr=False, compare=False)  # ``tensors`` as JSON, when
    # known (the capture plan cache reuses it while the tensors are unchanged)
    _index: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (tensors, {path: entry})

    def to_json(self) -> bytes:
        tensors = self.tensors_json
        if tensors is None:
            tensors = compact_json([t.to_dict() for t in self.tensors])
        head = compact_json({"version": self.version, "nbytes": self.nbytes, "meta": self.meta})
        return f'{head[:-1]},"tensors":{tensors},"tree":{compact_json(self.tree)}}}'.encode()

    @classmethod
    def from_json(cls, raw: bytes | str, what: str = "manifest") -> Manifest:
        """Parse and validate (``memsnap.state.validate``): ``FormatError`` names what is malformed."""
        doc = validate.parse_json(raw, what)
        validate.manifest_doc(doc, what)
        man = cls(
            tensors=[TensorEntry.from_dict(t) for t in doc["tensors"]],
            tree=doc["tree"],
            nbytes=doc["nbytes"],
            meta=doc.get("meta", {}),
        )
        validate.manifest(man, what)
        return man

    def with_checksums(self, checksums: list[str | None]) -> Manifest:
        return replace(
            self, tensors=[replace(t, checksum=c) for t, c in zip(self.tensors, checksums)], tensors_json=None
        )

    def entry(self, path: str) -> TensorEntry:
        """The (first) entry named ``path``, KeyError if none: a dict lookup, the index built
        once per list of tensors (a reader looks up every tensor, so a scan would be quadratic)."""
        index = self._index
        if index is None or index[0] is not self.tensors or len(index[1]) > len(self.tensors):
            by_path: dict[str, TensorEntry] = {}
            for t in self.tensors:
                by_path.setdefault(t.path, t)
            index = self._index = (self.tensors, by_path)
        try:
            return index[1][path]
        except KeyError:
            raise KeyError(path) from None
