"""``memsnap inspect URI[/step]``: a step's metadata and its tensors as a table (every string
from the checkpoint escaped: ``printable``)."""

from __future__ import annotations

import argparse
import json

from memsnap.commands._common import add_location, human, open_step, printable, table


def _flat(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", json.dumps(v) if not isinstance(v, str) else v))
    return out


def _sharding(t) -> str:
    if t.global_shape is None:
        return ""
    return f"{','.join(t.placements or ())} of {list(t.global_shape)} at {list(t.global_offset)}"


def run(args: argparse.Namespace) -> int:
    store, step, marker = open_step(args)
    manifest = store.manifest(step, args.rank, marker)
    print(f"step {step} of {printable(store.uri)} (rank {args.rank} of {marker['world_size']})")
    print(table(["METADATA", "VALUE"], _flat(marker.get("metadata", {}))))
    print()
    rows = [
        [t.path, t.dtype, list(t.shape), human(t.nbytes) if not t.alias_of else f"= {t.alias_of}", _sharding(t)]
        for t in manifest.tensors
    ]
    print(table(["TENSOR", "DTYPE", "SHAPE", "SIZE", "SHARDING"], rows))
    print(f"{len(manifest.tensors)} tensors, {human(manifest.nbytes)} in this rank's file")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("inspect", help="show a step's metadata and tensors", description=__doc__.split("\n")[0])
    add_location(ap)
    ap.add_argument("--rank", type=int, default=0, help="whose manifest to show (default 0)")
    ap.set_defaults(func=run)
    return ap
