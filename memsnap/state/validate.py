"""Structural checks of everything memsnap parses: manifests, skeletons, commit markers, wire headers.

Each check either returns or raises ``FormatError`` naming the field, the value and what to
do, before any byte of a snapshot is moved. Nothing here imports torch: the agent's send
path parses manifests in a process that never loads it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections.abc import Collection
from typing import Any

from memsnap.errors import FormatError

MAX_DEPTH = 100  # nesting of a skeleton; the decoder recurses, Python's limit is ~1000 frames
MAX_NAME = 4096  # characters of a tensor path or of a skeleton dict key
MAX_NDIM = 64
MAX_WORLD = 1 << 20
ALIGN = 64  # every tensor starts on a cache-line boundary of the buffer (manifest.ALIGN)
MAX_TENSORS = 1 << 18  # entries of one manifest (a large MoE model with its optimizer state has ~10**5)
MAX_BYTES = (1 << 63) - 1  # of a data file, a buffer, an offset
MAX_MARKER_BYTES = 256 << 20  # of a COMMITTED file (a world of MAX_WORLD ranks needs ~160 MiB)
MAX_MANIFEST_BYTES = 256 << 20  # of a rank manifest file (MAX_TENSORS entries need well under half)

# Bytes per element of every dtype a manifest may name (memsnap.state.dtypes builds its table from this).
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_PLACEMENT = re.compile(r"^(Shard\((0|[1-9]\d?)\)|Replicate\(\)|Partial\((sum|avg|max|min|product)?\))$")
_DEVICE = re.compile(
    r"^(cpu|cuda|mps|xpu|meta|hpu|mtia|xla|privateuseone|ipu|lazy|hip|maia|fpga|ve|vulkan)"
    r"(:(0|[1-9]\d?|1[01]\d|12[0-7]))?$"
)
_ENTRY_KEYS = frozenset(
    {
        "path",
        "dtype",
        "shape",
        "offset",
        "nbytes",
        "checksum",
        "device",
        "alias_of",
        "global_shape",
        "global_offset",
        "placements",
        "mesh_shape",
    }
)
_DAMAGED = "the file is damaged or was not written by memsnap; load another step or copy"
_UNSHOWN = object()


def fail(where: str, problem: str, value: Any = _UNSHOWN) -> FormatError:
    """A ``FormatError`` for ``where`` (a file, field or path) saying what is wrong with ``value``."""
    shown = "" if value is _UNSHOWN else f" (got {_short(value)})"
    return FormatError(f"{where}: {problem}{shown}; {_DAMAGED}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_json(raw: bytes | str, what: str) -> Any:
    """``raw`` decoded as JSON, or ``FormatError`` (bad UTF-8, bad syntax, too deeply nested)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise fail(what, "JSON is nested deeper than this Python can parse") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise fail(what, f"is not valid JSON: {exc}") from None


def is_int(v: Any) -> bool:
    return type(v) is int


def _count(where: str, v: Any, low: int = 0, high: int | None = None) -> int:
    if not is_int(v) or v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise fail(where, f"must be an integer {bound}", v)
    return v


def _ints(where: str, v: Any, low: int = 0) -> tuple[int, ...]:
    """A shape-like list: at most ``MAX_NDIM`` integers in ``low``..2**63-1."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NDIM:
        raise fail(where, f"must be a list of at most {MAX_NDIM} integers", v)
    return tuple(_count(f"{where}[{i}]", d, low, (1 << 63) - 1) for i, d in enumerate(v))


def _text(where: str, v: Any, limit: int = MAX_NAME, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or len(v) > limit or (pattern is not None and not pattern.fullmatch(v)):
        raise fail(
            where,
            f"must be a string of at most {limit} characters"
            + ("" if pattern is None else f" matching {pattern.pattern}"),
            v,
        )
    return v


def _dtype(where: str, v: Any) -> str:
    if not isinstance(v, str) or v not in ITEMSIZE:
        raise fail(where, f"is not a dtype memsnap stores (one of {', '.join(ITEMSIZE)})", v)
    return v


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nesting(where: str, value: Any) -> None:
    """Free-form JSON (metadata) nests at most ``MAX_DEPTH`` levels, so printing it cannot recurse
    too deep."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise fail(where, f"is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


# --- manifests -------------------------------------------------------------------------------
def manifest_doc(doc: Any, what: str = "manifest") -> None:
    """The decoded JSON of a manifest has the fields ``Manifest.from_json`` builds from."""
    if not isinstance(doc, dict):
        raise fail(what, "must be a JSON object", type(doc).__name__)
    if doc.get("version") != 1 or not is_int(doc.get("version")):
        raise fail(f"{what} version", "is not 1, the only format version this memsnap reads", doc.get("version"))
    _count(f"{what} nbytes", doc.get("nbytes"), 0, MAX_BYTES)
    if not isinstance(doc.get("meta", {}), dict):
        raise fail(f"{what} meta", "must be a JSON object", doc.get("meta"))
    nesting(f"{what} meta", doc.get("meta", {}))
    if not isinstance(doc.get("tensors"), list):
        raise fail(f"{what} tensors", "must be a list", doc.get("tensors"))
    _tensor_count(what, len(doc["tensors"]))
    if "tree" not in doc:
        raise fail(what, "has no skeleton ('tree')")
    for i, entry in enumerate(doc["tensors"]):
        _entry_doc(f"{what} tensors[{i}]", entry)


def _entry_doc(where: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise fail(where, "must be a JSON object", entry)
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise fail(where, f"has unknown fields {unknown}")
    missing = [k for k in ("path", "dtype", "shape", "offset", "nbytes") if k not in entry]
    if missing:
        raise fail(where, f"lacks the fields {missing}")
    for key in ("shape", "global_shape", "global_offset", "placements", "mesh_shape"):
        if entry.get(key) is not None and not isinstance(entry[key], list):
            raise fail(f"{where} {key}", "must be a list", entry[key])


def manifest(man: Any, what: str = "manifest") -> None:
    """Every entry of a ``Manifest`` lies inside its buffer, aliases name earlier entries, the
    skeleton is well formed: what apply, receive and reshard rely on before moving bytes."""
    total = _count(f"{what} nbytes", man.nbytes, 0, MAX_BYTES)
    _tensor_count(what, len(man.tensors))
    holders: dict[str, Any] = {}
    for i, e in enumerate(man.tensors):
        where = f"{what} tensors[{i}] ({_short(getattr(e, 'path', '?'))})"
        _entry(where, e, total)
        if e.alias_of is None:
            holders[e.path] = e
        else:
            _alias(where, e, holders.get(e.alias_of))
    skeleton(man.tree, len(man.tensors), f"{what} tree")


def _tensor_count(what: str, n: int) -> None:
    if n > MAX_TENSORS:
        raise fail(f"{what} tensors", f"lists {n} entries, more than the {MAX_TENSORS} a memsnap manifest holds")


def stored_checksums(man: Any, what: str = "manifest") -> None:
    """Every entry of a stored manifest that holds bytes has its checksum (a writer always
    records one, so a missing one is damage)."""
    for i, e in enumerate(man.tensors):
        if e.alias_of is None and e.checksum is None:
            raise fail(f"{what} tensors[{i}] ({_short(e.path)})", "has no checksum, which every stored tensor has")


def _entry(where: str, e: Any, total: int) -> None:
    _text(f"{where} path", e.path)
    shape = _ints(f"{where} shape", e.shape)
    size = ITEMSIZE[_dtype(f"{where} dtype", e.dtype)] * numel(shape)
    offset, nbytes = _count(f"{where} offset", e.offset), _count(f"{where} nbytes", e.nbytes)
    if offset % ALIGN:
        raise fail(f"{where} offset", f"is not a multiple of {ALIGN}", offset)
    if e.alias_of is None and nbytes != size:
        raise fail(f"{where} nbytes", f"must be {size} for {e.dtype}{list(shape)}", nbytes)
    if offset + nbytes > total:
        raise fail(where, f"bytes {offset}..{offset + nbytes} run past the {total}-byte buffer")
    if e.checksum is not None:
        _text(f"{where} checksum", e.checksum, 16, _HEX16)
    _text(f"{where} device", e.device, 64)
    if e.alias_of is not None:
        _text(f"{where} alias_of", e.alias_of)
    _sharding(where, e, shape)


def _alias(where: str, e: Any, holder: Any) -> None:
    if holder is None:
        raise fail(f"{where} alias_of", "names no earlier entry that holds bytes", e.alias_of)
    if e.nbytes != 0 or e.offset != holder.offset:
        raise fail(where, f"an alias must have 0 bytes at its holder's offset {holder.offset}", (e.offset, e.nbytes))
    if (e.dtype, tuple(e.shape)) != (holder.dtype, tuple(holder.shape)):
        raise fail(where, f"is an alias of {holder.dtype}{list(holder.shape)} but claims {e.dtype}{list(e.shape)}")


def _sharding(where: str, e: Any, shape: tuple[int, ...]) -> None:
    fields = (e.global_shape, e.global_offset, e.placements, e.mesh_shape)
    if all(f is None for f in fields):
        return
    if any(f is None for f in fields):
        raise fail(where, "a sharded entry needs global_shape, global_offset, placements and mesh_shape")
    whole = _ints(f"{where} global_shape", e.global_shape)
    start = _ints(f"{where} global_offset", e.global_offset)
    if len(whole) != len(shape) or len(start) != len(shape):
        raise fail(
            where,
            f"global_shape {list(whole)} / global_offset {list(start)} do not have "
            f"the {len(shape)} dimensions of the shard",
        )
    if any(o + n > g for o, n, g in zip(start, shape, whole)):
        raise fail(where, f"shard {list(shape)} at {list(start)} runs outside {list(whole)}")
    mesh = _ints(f"{where} mesh_shape", e.mesh_shape, low=1)
    places = e.placements
    if not isinstance(places, (list, tuple)) or len(places) != len(mesh):
        raise fail(f"{where} placements", f"must list one placement per mesh dimension ({len(mesh)})", places)
    for j, p in enumerate(places):
        m = _PLACEMENT.fullmatch(_text(f"{where} placements[{j}]", p, 32, _PLACEMENT))
        assert m is not None  # _text checked the pattern
        if m.group(2) is not None and int(m.group(2)) >= len(whole):
            raise fail(f"{where} placements[{j}]", f"shards a dimension the {len(whole)}-d tensor lacks", p)


# --- skeletons -------------------------------------------------------------------------------
_KEY_TAGS = frozenset(
    {"__tuple__", "__float__", "__bytes__", "__size__", "__dtype__", "__device__", "__npscalar__"}
)  # tags whose decoded value can be a dict key
_TAGS = _KEY_TAGS | {"__dict__", "__tensor__", "__ndarray__"}  # = memsnap.state.tree.TAGS


def skeleton(tree: Any, n_tensors: int, what: str = "tree") -> None:
    """``tree`` is what ``memsnap.state.tree.decode`` accepts: tags with well-formed bodies, tensor
    indices below ``n_tensors``, nesting at most ``MAX_DEPTH``, hashable dict keys."""
    stack = [(tree, what, 0, False)]  # (node, path, depth, used as a dict key)
    while stack:
        node, path, depth, as_key = stack.pop()
        if depth > MAX_DEPTH:
            raise fail(path, f"skeleton is nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            continue
        if not isinstance(node, (list, dict)):
            raise fail(path, "is not a JSON value", type(node).__name__)
        if as_key and (isinstance(node, list) or _tag(node) not in _KEY_TAGS):
            raise fail(path, "a dict key must decode to a hashable value", node)
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}", depth + 1, False) for i, v in enumerate(node))
        elif _tag(node) is None:
            for k, v in node.items():
                _text(f"{path} key", k)
                stack.append((v, f"{path}/{k}", depth + 1, False))
        else:
            stack.extend(_tagged(node, path, depth, n_tensors, as_key))


def _tag(node: dict) -> str | None:
    if len(node) != 1:
        return None
    tag = next(iter(node))
    return tag if tag in _TAGS else None


def _tagged(node: dict, path: str, depth: int, n_tensors: int, as_key: bool) -> list:
    """Check one tagged node; return the children still to visit."""
    ((tag, body),) = node.items()
    where = f"{path} {tag}"
    if tag in ("__tuple__", "__dict__"):
        if not isinstance(body, list):
            raise fail(where, "must hold a list", body)
        if tag == "__tuple__":
            return [(v, f"{path}/{i}", depth + 1, as_key) for i, v in enumerate(body)]
        return _pairs(where, body, path, depth)
    if tag == "__tensor__":
        _count(where, body, 0, n_tensors - 1)
    elif tag == "__float__":
        if body not in ("inf", "-inf", "nan"):
            raise fail(where, "must be 'inf', '-inf' or 'nan'", body)
    else:
        _leaf(where, tag, body)
    return []


def _pairs(where: str, body: list, path: str, depth: int) -> list:
    out = []
    for i, pair in enumerate(body):
        if not isinstance(pair, list) or len(pair) != 2:
            raise fail(f"{where}[{i}]", "must be a [key, value] pair", pair)
        out.append((pair[0], f"{path}/<key {i}>", depth + 1, True))
        out.append((pair[1], f"{path}/{i}", depth + 1, False))
    return out


def _leaf(where: str, tag: str, body: Any) -> None:
    if tag == "__bytes__":
        b64(where, body)
    elif tag == "__size__":
        _ints(where, body)
    elif tag == "__dtype__":
        _dtype(where, body)
    elif tag == "__device__":
        _text(where, body, 32, _DEVICE)
    elif tag == "__ndarray__":
        _ndarray(where, body)
    else:  # "__npscalar__"
        if not isinstance(body, list) or len(body) != 2:
            raise fail(where, "must be [dtype, base64]", body)
        if len(b64(where, body[1])) != _np_dtype(where, body[0]).itemsize:
            raise fail(where, "holds a number of bytes other than its dtype's size", body)


def b64(where: str, body: Any) -> bytes:
    """``body`` as base64 text decoded, or ``FormatError``."""
    try:
        return base64.b64decode(_text(where, body, 1 << 30).encode("ascii"), validate=True)
    except (binascii.Error, ValueError):
        raise fail(where, "is not base64 text", body) from None


def _np_dtype(where: str, name: Any) -> Any:
    import numpy as np

    try:
        dt = np.dtype(_text(where, name, 64))
    except (TypeError, ValueError, SyntaxError):
        raise fail(where, "names no numpy dtype", name) from None
    if dt.hasobject or dt.itemsize == 0 or dt.shape != ():
        raise fail(where, "names a numpy dtype without a fixed byte layout", name)
    return dt


def _ndarray(where: str, body: Any) -> None:
    if not isinstance(body, list) or len(body) != 3:
        raise fail(where, "must be [dtype, shape, base64]", body)
    dt, shape = _np_dtype(where, body[0]), _ints(where, body[1])
    if len(b64(where, body[2])) != dt.itemsize * numel(shape):
        raise fail(where, f"does not hold the bytes of a {dt.str}{list(shape)} array")


# --- commit markers ------------------------------------------------------------------------------
def marker(doc: Any, step: int, where: str = "COMMITTED") -> dict:
    """A parsed ``COMMITTED`` of ``step``: its world size, metadata and one record per rank."""
    if not isinstance(doc, dict):
        raise fail(where, "must be a JSON object", type(doc).__name__)
    if doc.get("format") != "memsnap" or doc.get("version") != 1 or not is_int(doc.get("version")):
        raise fail(
            where,
            "is not a version-1 memsnap commit marker",
            {"format": doc.get("format"), "version": doc.get("version")},
        )
    if not is_int(doc.get("step")) or doc["step"] != step:
        raise fail(f"{where} step", f"must be {step}, the step of its directory", doc.get("step"))
    world = _count(f"{where} world_size", doc.get("world_size"), 1, MAX_WORLD)
    if not isinstance(doc.get("metadata", {}), dict):
        raise fail(f"{where} metadata", "must be a JSON object", doc.get("metadata"))
    nesting(f"{where} metadata", doc.get("metadata", {}))
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world:
        raise fail(
            f"{where} ranks",
            f"must list world_size={world} rank records",
            f"{len(ranks)} records" if isinstance(ranks, list) else ranks,
        )
    for r, rec in enumerate(ranks):
        _rank_record(f"{where} ranks[{r}]", rec, r)
    return doc


def _rank_record(where: str, rec: Any, rank: int) -> None:
    if not isinstance(rec, dict):
        raise fail(where, "must be a JSON object", rec)
    if rec.get("rank") != rank or not is_int(rec.get("rank")):
        raise fail(f"{where} rank", f"must be {rank}", rec.get("rank"))
    _count(f"{where} bin_bytes", rec.get("bin_bytes"), 0, MAX_BYTES)
    _count(f"{where} json_bytes", rec.get("json_bytes"), 0, MAX_MANIFEST_BYTES)
    for key in ("bin_xxh3", "json_xxh3"):
        _text(f"{where} {key}", rec.get(key), 16, _HEX16)


# --- wire headers ---------------------------------------------------------------------------------
def wire_header(
    raw: bytes, layout: struct.Struct, kinds: Collection[int], max_payload: int, what: str
) -> tuple[int, ...]:
    """The fields of a data-plane header, checked: ``(kind, text length, payload length, ...)``
    and whatever the layout carries after them."""
    if len(raw) != layout.size:
        raise FormatError(
            f"bad {what} header: {len(raw)} bytes, expected {layout.size}; "
            "the peer does not speak this memsnap's data-plane protocol"
        )
    fields = layout.unpack(raw)
    kind, nbytes = fields[0], fields[2]
    if kind not in kinds or nbytes > max_payload:
        raise FormatError(
            f"bad {what} header: kind={kind} (known: {sorted(kinds)}), payload "
            f"{nbytes} bytes (limit {max_payload}); the peer is not a compatible "
            "memsnap agent or the stream lost its framing; reconnect"
        )
    return fields
