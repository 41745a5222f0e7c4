"""``memsnap ls URI``: the committed steps of a checkpoint root, one line each."""
from __future__ import annotations

import argparse

from memsnap.commands._common import add_location, human, table
from memsnap.storage import Store


def _row(step: int, marker: dict) -> list:
    md = marker.get("metadata", {})
    loss = md.get("user", {}).get("loss")
    git = (md.get("git") or {}).get("commit", "")[:10]
    return [step, md.get("time_utc", "?"), marker["world_size"],
            human(sum(r["bin_bytes"] for r in marker["ranks"])),
            "" if loss is None else f"{loss:.6g}", "yes" if md.get("milestone") else "", git]


def run(args: argparse.Namespace) -> int:
    store = Store.open(args.location, args.endpoint)
    steps = store.steps()
    if not steps:
        print(f"no committed steps under {args.location}")
        return 0
    rows = [_row(s, store.marker(s)) for s in steps]
    print(table(["STEP", "SAVED (UTC)", "RANKS", "SIZE", "LOSS", "MILESTONE", "GIT"], rows))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("ls", help="list committed steps", description=__doc__.split("\n")[0])
    add_location(ap, step=False)
    ap.set_defaults(func=run)
    return ap
