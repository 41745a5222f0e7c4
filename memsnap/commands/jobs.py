"""``memsnap jobs``: the memsnap jobs running on a Ray cluster, from their named actors."""

from __future__ import annotations

import argparse
import json

from memsnap.commands._cluster import add_address, connect, jobs
from memsnap.commands._common import table


def rows(found: dict[str, dict]) -> list[list]:
    """One row per job: whether its coordinator runs, and how many agents (nodes) it has."""
    return [[job, "yes" if e["coordinator"] else "no", len(e["agents"])] for job, e in sorted(found.items())]


def run(args: argparse.Namespace) -> int:
    connect(args)
    found = jobs()
    if args.json:
        print(json.dumps(found, sort_keys=True))
    elif not found:
        print("no memsnap jobs on this cluster")
    else:
        print(table(["JOB", "COORDINATOR", "AGENTS"], rows(found)))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser(
        "jobs", help="list the memsnap jobs on a running cluster", description=__doc__.split("\n")[0]
    )
    add_address(ap)
    ap.add_argument("--json", action="store_true", help="as JSON: {job: {coordinator, agents}}")
    ap.set_defaults(func=run)
    return ap
