"""The JSON skeleton of a state: nested values in, tagged JSON out, and back, exactly.

Plain JSON cannot tell a tuple from a list, has no int dict keys and no inf/nan. The
skeleton keeps all of these by wrapping them in single-key objects whose key is a tag:

    tuple           {"__tuple__": [items]}
    non-str keys    {"__dict__": [[key, value], ...]}     (also for dicts that look like a tag)
    inf/-inf/nan    {"__float__": "inf"}                  (finite floats stay plain JSON)
    tensor          {"__tensor__": i}                     (i indexes Manifest.tensors)
    bytes           {"__bytes__": base64}
    torch.Size      {"__size__": [dims]}
    torch.dtype     {"__dtype__": "float32"}
    torch.device    {"__device__": "cuda:0"}
    numpy array     {"__ndarray__": [dtype str, [shape], base64]}
    numpy scalar    {"__npscalar__": [dtype str, base64]}

Tensors never enter the JSON: ``encode`` hands each one to a callback that returns its index,
and ``decode`` asks a callback for the tensor at each index. Both name each tensor by its
position in the skeleton: the keys from the root down, each written by ``segment`` and
joined by ``/`` (``child_path``), so that distinct positions never share a name.

Refused at encode, each with ``UnsupportedStateError``: values of other types, ``bytearray``
(it would come back as ``bytes``), numpy dtypes their dtype string cannot rebuild (structured,
zero-sized), and integers of more than ``MAX_INT_DIGITS`` digits (more than a load parses).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memsnap.errors import UnsupportedStateError
from memsnap.state.dtypes import dtype_name, dtype_of
from memsnap.state.validate import MAX_DEPTH

OnTensor = Callable[[torch.Tensor, str], int]
TensorAt = Callable[[int, str], Any]
MAX_INT_DIGITS = 4300  # Python's default limit of int <-> str conversion: what json.loads parses
_INT_LIMIT = 10**MAX_INT_DIGITS
_INT_LIKE = re.compile(r"-?[0-9]+")
_ESCAPE_FIRST = frozenset("<-0123456789")  # how an int's or a non-string key's name may start

TAGS = frozenset(
    {
        "__tuple__",
        "__dict__",
        "__float__",
        "__tensor__",
        "__bytes__",
        "__size__",
        "__dtype__",
        "__device__",
        "__ndarray__",
        "__npscalar__",
    }
)


def _quote(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


def segment(key: Any) -> str:
    """The name of a key (a container index, or a dict key as the skeleton writes it) in a
    tensor's name, one-to-one: an int is its digits (``"0"``); a string is itself with ``%``
    and ``/`` percent-escaped, and its first character too when it would read as an int or
    as a tagged key (``"0"`` -> ``"%30"``); any other key is its skeleton JSON in ``<...>``
    (``1.5`` -> ``"<1.5>"``, ``True`` -> ``"<true>"``), escaped the same way."""
    if type(key) is str:
        text = _quote(key) if "%" in key or "/" in key else key
        if text[:1] in _ESCAPE_FIRST and (text[0] == "<" or _INT_LIKE.fullmatch(text)):
            text = f"%{ord(text[0]):02X}{text[1:]}"
        return text
    if type(key) is int:
        return str(key)
    return f"<{_quote(json.dumps(key, separators=(',', ':'), allow_nan=False))}>"


def unquote(seg: str) -> str:
    """The string key a ``segment`` names (``"a%2Fb"`` -> ``"a/b"``)."""
    return re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), seg)


def child_path(path: str | None, seg: str) -> str:
    """The name of the position ``seg`` (a ``segment``) inside the container named ``path``
    (None: the state itself): ``"optim/state/0/exp_avg"``."""
    return seg if path is None else f"{path}/{seg}"


def _where(path: str | None) -> str:
    return "<root>" if path is None else repr(path)


def tensor_names(skeleton: Any) -> dict[int, str]:
    """``{tensor index: name}`` for every tensor leaf of a (validated) skeleton."""
    names: dict[int, str] = {}

    def tensor_at(i: int, path: str) -> None:
        names.setdefault(i, path)

    decode(skeleton, tensor_at)
    return names


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _encode_float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"__float__": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _encode_dict(d: dict, on_tensor: OnTensor, path: str | None, depth: int) -> Any:
    plain = all(type(k) is str for k in d) and not (len(d) == 1 and next(iter(d)) in TAGS)
    if plain:
        return {k: encode(v, on_tensor, child_path(path, segment(k)), depth + 1) for k, v in d.items()}
    pairs = []
    for k, v in d.items():
        key = encode(k, on_tensor, path, depth + 1)
        pairs.append([key, encode(v, on_tensor, child_path(path, segment(key)), depth + 1)])
    return {"__dict__": pairs}


def _numpy_dtype(x: Any, path: str | None) -> str:
    """The dtype string of a numpy value, refused when it does not rebuild the dtype exactly."""
    dt = x.dtype
    if dt.hasobject:
        raise UnsupportedStateError(
            f"numpy value at {_where(path)} holds Python objects (dtype {dt}), "
            "which a snapshot cannot store; store plain values"
        )
    if dt.names is not None or dt.itemsize == 0 or np.dtype(dt.str) != dt:
        raise UnsupportedStateError(
            f"numpy value at {_where(path)} has dtype {dt}, which a snapshot cannot write out exactly "
            "(structured or zero-sized); store each field as its own array (x['name'])"
        )
    return dt.str


def _encode_numpy(x: Any, path: str | None) -> Any:
    dt = _numpy_dtype(x, path)
    if isinstance(x, np.ndarray):
        return {"__ndarray__": [dt, list(x.shape), _b64(np.ascontiguousarray(x).tobytes())]}
    return {"__npscalar__": [dt, _b64(x.tobytes())]}


def _encode_int(v: int, path: str | None) -> int:
    if not -_INT_LIMIT < v < _INT_LIMIT:
        digits = int(v.bit_length() * math.log10(2)) + 1
        raise UnsupportedStateError(
            f"integer at {_where(path)} has about {digits} digits, more than the {MAX_INT_DIGITS} "
            "a snapshot can be loaded back with; store it as a string or bytes"
        )
    return v


def encode(value: Any, on_tensor: OnTensor, path: str | None = None, depth: int = 0) -> Any:
    """The tagged JSON skeleton of ``value``; each tensor goes to ``on_tensor(t, name)``, named
    by its position below ``path`` (None: ``value`` is the whole state). Containers nest at
    most ``validate.MAX_DEPTH`` deep (what a load accepts)."""
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(
            f"value at {_where(path)} is nested deeper than {MAX_DEPTH} containers, more than "
            "a snapshot can be loaded back with; flatten the state"
        )
    if value is None or type(value) is bool or type(value) is str:
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": on_tensor(value, "" if path is None else path)}
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_numpy(value, path)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return _encode_int(int(value), path)
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, dict):
        return _encode_dict(value, on_tensor, path, depth)
    return _encode_other(value, on_tensor, path, depth)


def _encode_other(value: Any, on_tensor: OnTensor, path: str | None, depth: int) -> Any:
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, on_tensor, child_path(path, str(i)), depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, on_tensor, child_path(path, str(i)), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, bytearray):
        raise UnsupportedStateError(
            f"value at {_where(path)} is a bytearray, which a snapshot would give back as bytes; "
            "store bytes(value) and rebuild the bytearray after loading"
        )
    if isinstance(value, bytes):
        return {"__bytes__": _b64(bytes(value))}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    raise UnsupportedStateError(
        f"value at {_where(path)} has type {type(value).__qualname__}, which a snapshot "
        f"cannot store exactly; give the object a state_dict() that returns tensors, numbers, "
        f"strings, None, bytes and dicts/lists/tuples of them"
    )


def _decode_tagged(tag: str, body: Any, tensor_at: TensorAt, path: str | None) -> Any:
    if tag == "__tensor__":
        return tensor_at(body, "" if path is None else path)
    if tag == "__tuple__":
        return tuple(decode(v, tensor_at, child_path(path, str(i))) for i, v in enumerate(body))
    if tag == "__dict__":
        out = {}
        for k, v in body:
            key = decode(k, tensor_at, path)
            out[key] = decode(v, tensor_at, child_path(path, segment(k)))
        return out
    if tag == "__float__":
        return float(body)
    return _decode_leaf(tag, body)


def _decode_leaf(tag: str, body: Any) -> Any:
    if tag == "__bytes__":
        return _unb64(body)
    if tag == "__size__":
        return torch.Size(body)
    if tag == "__dtype__":
        return dtype_of(body)
    if tag == "__device__":
        return torch.device(body)
    if tag == "__ndarray__":
        dt, shape, raw = body
        return np.frombuffer(_unb64(raw), dtype=np.dtype(dt)).reshape(shape).copy()
    dt, raw = body  # "__npscalar__"
    return np.frombuffer(_unb64(raw), dtype=np.dtype(dt))[0]


def decode(tree: Any, tensor_at: TensorAt, path: str | None = None) -> Any:
    """The value ``encode`` was given; each tensor comes from ``tensor_at(index, name)``,
    named as ``encode`` named it."""
    if isinstance(tree, list):
        return [decode(v, tensor_at, child_path(path, str(i))) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag in TAGS:
            return _decode_tagged(tag, body, tensor_at, path)
    return {k: decode(v, tensor_at, child_path(path, segment(k))) for k, v in tree.items()}
