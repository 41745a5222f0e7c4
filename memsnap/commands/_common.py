"""Helpers the checkpoint commands share: URI[/step] arguments, opening a step, tables, sizes."""
from __future__ import annotations

import argparse
import re
from typing import Any, Sequence

from memsnap.errors import ConfigError, UnsupportedStateError
from memsnap.manifest import Manifest
from memsnap.storage import Store

DAMAGED = 2  # exit code of a command that found the checkpoint damaged or malformed
_STEP_TAIL = re.compile(r"^(?:step_)?(\d+)$")


def add_location(ap: argparse.ArgumentParser, *, step: bool = True) -> None:
    ap.add_argument("location", metavar="URI/step" if step else "URI",
                    help="checkpoint root (path, file://, s3://, gs://, hdfs://)"
                    + (", optionally followed by /step_NNN or /NNN (default: newest step)" if step else ""))
    ap.add_argument("--endpoint", default=None,
                    help="S3 endpoint URL (default: $AWS_ENDPOINT_URL, else AWS)")


def split_location(location: str) -> tuple[str, int | None]:
    """``root/step_000000000012`` or ``root/12`` -> ``(root, 12)``; a plain root -> ``(root, None)``."""
    head, _, tail = location.rstrip("/").rpartition("/")
    m = _STEP_TAIL.match(tail)
    if head and m:
        return head, int(m.group(1))
    return location, None


def open_step(args: argparse.Namespace) -> tuple[Store, int, dict]:
    """The store, the step (given or newest) and its commit marker."""
    uri, step = split_location(args.location)
    store = Store.open(uri, args.endpoint)
    step = store.latest() if step is None else step
    return store, step, store.marker(step)


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned text columns, with a header line."""
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def _unstorable(name: str, dtype: Any) -> UnsupportedStateError:
    return UnsupportedStateError(f"tensor {name!r} is {dtype}, which safetensors cannot store; convert "
                                 "it in the training code, or export with --key a state key without it")


def weight_paths(manifest: Manifest, key: str | None) -> tuple[str, list[str]]:
    """The top-level key holding the model weights and its tensor paths (``key`` or "model")."""
    keys = [k for k in manifest.tree if not k.startswith("__")] if isinstance(manifest.tree, dict) else []
    key = key or ("model" if "model" in keys else None)
    if key is None or key not in keys:
        raise ConfigError(f"cannot tell which state key holds the weights (keys: {keys}); "
                          "pass --key NAME")
    paths = [t.path for t in manifest.tensors if t.path.startswith(key + "/")]
    if not paths:
        raise ConfigError(f"state key {key!r} holds no tensors; pass --key with one of {keys}")
    return key, paths


def write_safetensors(tensors: dict, path: str, metadata: dict[str, str]) -> str:
    """Write ``tensors`` to ``path`` as safetensors; return their total size, human-readable.
    A dtype safetensors has no code for is an ``UnsupportedStateError`` naming the tensor."""
    import safetensors.torch
    from safetensors.torch import save_file

    known = set(getattr(safetensors.torch, "_TYPES", {}).values())
    for name, t in tensors.items():
        if known and t.dtype not in known:
            raise _unstorable(name, t.dtype)
    try:
        save_file(tensors, path, metadata=metadata)
    except KeyError as exc:  # safetensors' lookup of a dtype it has no code for
        bad = next((n for n, t in tensors.items() if t.dtype == exc.args[0]), "?")
        raise _unstorable(bad, exc.args[0]) from None
    return human(sum(t.numel() * t.element_size() for t in tensors.values()))
