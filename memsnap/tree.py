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
and ``decode`` asks a callback for the tensor at each index.
"""
from __future__ import annotations

import base64
import math
from typing import Any, Callable

import numpy as np
import torch

from memsnap.dtypes import dtype_name, dtype_of
from memsnap.errors import UnsupportedStateError
from memsnap.validate import MAX_DEPTH

OnTensor = Callable[[torch.Tensor, str], int]
TensorAt = Callable[[int, str], Any]

TAGS = frozenset({
    "__tuple__", "__dict__", "__float__", "__tensor__", "__bytes__", "__size__", "__dtype__",
    "__device__", "__ndarray__", "__npscalar__",
})


def child_path(path: str, key: Any) -> str:
    """The path of ``key`` inside the container at ``path`` (``"optim/state/0"``)."""
    return f"{path}/{key}" if path else str(key)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _encode_float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"__float__": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _encode_dict(d: dict, on_tensor: OnTensor, path: str, depth: int) -> Any:
    plain = all(type(k) is str for k in d) and not (len(d) == 1 and next(iter(d)) in TAGS)
    if plain:
        return {k: encode(v, on_tensor, child_path(path, k), depth + 1) for k, v in d.items()}
    return {"__dict__": [
        [encode(k, on_tensor, path, depth + 1), encode(v, on_tensor, child_path(path, k), depth + 1)]
        for k, v in d.items()
    ]}


def _encode_numpy(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedStateError(f"numpy object array {x!r} cannot be snapshotted; store plain values")
        return {"__ndarray__": [x.dtype.str, list(x.shape), _b64(np.ascontiguousarray(x).tobytes())]}
    return {"__npscalar__": [x.dtype.str, _b64(x.tobytes())]}


def encode(value: Any, on_tensor: OnTensor, path: str = "", depth: int = 0) -> Any:
    """The tagged JSON skeleton of ``value``; each tensor goes to ``on_tensor(t, path)``.
    Containers nest at most ``validate.MAX_DEPTH`` deep (what a load accepts)."""
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(
            f"value at {path or '<root>'!r} is nested deeper than {MAX_DEPTH} containers, more than "
            "a snapshot can be loaded back with; flatten the state")
    if value is None or type(value) is bool or type(value) is str:
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": on_tensor(value, path)}
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_numpy(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, dict):
        return _encode_dict(value, on_tensor, path, depth)
    return _encode_other(value, on_tensor, path, depth)


def _encode_other(value: Any, on_tensor: OnTensor, path: str, depth: int) -> Any:
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, on_tensor, child_path(path, i), depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, on_tensor, child_path(path, i), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": _b64(bytes(value))}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    raise UnsupportedStateError(
        f"value at {path or '<root>'!r} has type {type(value).__qualname__}, which a snapshot "
        f"cannot store exactly; give the object a state_dict() that returns tensors, numbers, "
        f"strings, None, bytes and dicts/lists/tuples of them"
    )


def _decode_tagged(tag: str, body: Any, tensor_at: TensorAt, path: str) -> Any:
    if tag == "__tensor__":
        return tensor_at(body, path)
    if tag == "__tuple__":
        return tuple(decode(v, tensor_at, child_path(path, i)) for i, v in enumerate(body))
    if tag == "__dict__":
        out = {}
        for k, v in body:
            key = decode(k, tensor_at, path)
            out[key] = decode(v, tensor_at, child_path(path, key))
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


def decode(tree: Any, tensor_at: TensorAt, path: str = "") -> Any:
    """The value ``encode`` was given; each tensor comes from ``tensor_at(index, path)``."""
    if isinstance(tree, list):
        return [decode(v, tensor_at, child_path(path, i)) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, body), = tree.items()
        if tag in TAGS:
            return _decode_tagged(tag, body, tensor_at, path)
    return {k: decode(v, tensor_at, child_path(path, k)) for k, v in tree.items()}
