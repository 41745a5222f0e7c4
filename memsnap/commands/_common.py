"""Helpers the checkpoint commands share: URI[/step] arguments, opening a step, tables, sizes,
and the escaping of every string a checkpoint or a cluster hands the terminal."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from memsnap.durable.storage import Store
from memsnap.errors import ConfigError, UnsupportedStateError
from memsnap.state.manifest import Manifest

DAMAGED = 2  # exit code of a command that found the checkpoint damaged or malformed
_STEP_TAIL = re.compile(r"(?:step_)?(\d+)")
# C0 and C1 controls, DEL, line/paragraph separators, bidi embeddings/overrides/isolates and marks,
# lone surrogates: what would move the cursor, clear the screen, write the clipboard (OSC 52),
# reorder a line or fail to encode if printed raw
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    code = ord(c)
    return _NAMED.get(c) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(value: Any) -> str:
    """``str(value)`` safe to print on a terminal: controls, bidi overrides and lone surrogates
    become ``\\xNN`` / ``\\uNNNN`` escapes (``\\n``, ``\\r``, ``\\t`` for those three); every other
    character, printable Unicode included, stays as it is. Every CLI line that carries a string
    from a checkpoint, a log or a cluster goes through it."""
    return _UNSAFE.sub(_escape, str(value))


def add_location(ap: argparse.ArgumentParser, *, step: bool = True) -> None:
    ap.add_argument(
        "location",
        metavar="URI/step" if step else "URI",
        help="checkpoint root (path, file://, s3://, gs://, hdfs://)"
        + (
            ", optionally followed by /step_NNN or /NNN (default: newest step); a root that "
            "holds committed steps is that root whatever its name"
            if step
            else ""
        ),
    )
    if step:
        ap.add_argument(
            "--step",
            type=int,
            default=None,
            metavar="N",
            help="the step of the root URI (instead of a /step_NNN or /NNN suffix)",
        )
    ap.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: $AWS_ENDPOINT_URL, else AWS)")


def split_location(location: str) -> tuple[str, int | None]:
    """``root/step_000000000012`` or ``root/12`` -> ``(root, 12)``; a plain root -> ``(root, None)``."""
    head, _, tail = location.rstrip("/").rpartition("/")
    m = _STEP_TAIL.fullmatch(tail)
    if head and m:
        return head, int(m.group(1))
    return location, None


def locate(location: str, endpoint: str | None, step: int | None = None) -> tuple[Store, int | None]:
    """The checkpoint root and the step (None: newest) that ``location`` names. With ``step``
    (``--step N``) ``location`` is the root. Otherwise a location that holds committed steps is
    a root, whatever its last component (``/data/2024`` is the root ``2024``); any other whose last
    component is ``step_NNN`` or ``NNN`` names that step of its parent."""
    if step is not None and step < 0:
        raise ConfigError(f"--step {step}: steps are numbered from 0; pass a committed step (`memsnap ls`)")
    store = Store.open(location, endpoint)
    if step is not None:
        return store, step
    head, tail_step = split_location(location)
    if tail_step is None or store.steps():
        return store, None
    return Store.open(head, endpoint), tail_step


def open_step(args: argparse.Namespace) -> tuple[Store, int, dict]:
    """The store, the step (given or newest) and its commit marker."""
    store, step = locate(args.location, args.endpoint, getattr(args, "step", None))
    step = store.latest() if step is None else step
    return store, step, store.marker(step)


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def format_duration(seconds: float) -> str:
    """A short human duration: ms, s, min, h or d."""
    for unit, size, limit in (("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0), ("h", 3600.0, 172800.0)):
        if seconds < limit:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds / 86400.0:.1f} d"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned text columns, with a header line; every cell through ``printable``."""
    cells = [list(map(printable, headers))] + [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def _unstorable(name: str, dtype: Any) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"tensor {name!r} is {dtype}, which safetensors cannot store; convert "
        "it in the training code, or export with --key a state key without it"
    )


def weight_paths(manifest: Manifest, key: str | None) -> tuple[str, list[str]]:
    """The top-level key holding the model weights and its tensor paths (``key`` or "model")."""
    keys = [k for k in manifest.tree if not k.startswith("__")] if isinstance(manifest.tree, dict) else []
    key = key or ("model" if "model" in keys else None)
    if key is None or key not in keys:
        raise ConfigError(f"cannot tell which state key holds the weights (keys: {keys}); pass --key NAME")
    # memsnap.state.tree imports torch: only the commands that read tensors get here
    from memsnap.state.tree import segment

    paths = [t.path for t in manifest.tensors if t.path.startswith(segment(key) + "/")]
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
