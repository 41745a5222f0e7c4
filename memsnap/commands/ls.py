"""``memsnap ls URI``: the committed steps of a checkpoint root, one line each.

A step whose commit marker is malformed is listed as DAMAGED (reason on stderr), exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from memsnap.commands._common import DAMAGED, add_location, human, printable, table
from memsnap.durable.storage import Store
from memsnap.errors import FormatError


def _loss(md: dict) -> str:
    loss = md.get("user", {}).get("loss") if isinstance(md.get("user"), dict) else None
    return f"{loss:.6g}" if isinstance(loss, (int, float)) and not isinstance(loss, bool) else ""


def _row(step: int, marker: dict) -> list:
    md = marker.get("metadata", {})
    git = md.get("git") if isinstance(md.get("git"), dict) else {}
    commit = git.get("commit")
    if not isinstance(commit, str):
        commit = ""
    return [
        step,
        md.get("time_utc", "?"),
        marker["world_size"],
        human(sum(r["bin_bytes"] for r in marker["ranks"])),
        _loss(md),
        "yes" if md.get("milestone") else "",
        commit[:10],
    ]


def run(args: argparse.Namespace) -> int:
    store = Store.open(args.location, args.endpoint)
    steps = store.steps()
    if not steps:
        print(f"no committed steps under {printable(args.location)}")
        return 0
    rows, damaged = [], 0
    for s in steps:
        try:
            rows.append(_row(s, store.marker(s)))
        except FormatError as exc:
            damaged += 1
            rows.append([s, "DAMAGED", "", "", "", "", ""])
            print(f"memsnap ls: damaged checkpoint: {printable(exc)}", file=sys.stderr)
    print(table(["STEP", "SAVED (UTC)", "RANKS", "SIZE", "LOSS", "MILESTONE", "GIT"], rows))
    return DAMAGED if damaged else 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("ls", help="list committed steps", description=__doc__.split("\n")[0])
    add_location(ap, step=False)
    ap.set_defaults(func=run)
    return ap
