"""``memsnap verify URI[/step]``: read every rank's files and check every checksum.

Exit code 0 when every step checked is intact, 2 (``DAMAGED``) when any is damaged or malformed.
"""

from __future__ import annotations

import argparse

from memsnap.commands._common import DAMAGED, add_location, human, locate, open_step, printable
from memsnap.durable.checkpoint import progress_bar
from memsnap.durable.storage import Store
from memsnap.errors import ConfigError, FormatError, MemsnapError
from memsnap.state.reshard import tiling


def verify_step(store: Store, step: int, marker: dict, progress: bool | None = None) -> list[str]:
    """Every problem found in ``step`` (empty: intact): each rank's files as every reader
    checks them (``Store.read_rank``), and the shards of every sharded tensor tiling it
    (``reshard.tiling``)."""
    problems, saved = [], []
    total = sum(r["bin_bytes"] for r in marker["ranks"])
    update, close = progress_bar(f"verify step {step}", total, progress)
    done = 0
    try:
        for rank in range(marker["world_size"]):
            try:
                report = None if update is None else (lambda d, t, base=done: update(base + d, total))
                saved.append(store.read_rank(step, rank, marker=marker, progress=report)[0])
            except (MemsnapError, OSError, ValueError) as exc:
                problems.append(f"rank {rank}: {exc}")
            done += marker["ranks"][rank]["bin_bytes"]
    finally:
        close()
    if not problems:
        problems += _tiling(saved)
    return problems


def _tiling(saved: list) -> list[str]:
    """The sharded tensors whose saved shards do not tile them."""
    out = []
    for e in saved[0].tensors:
        if e.global_shape is not None and e.alias_of is None:
            try:
                tiling(saved, e.path)
            except MemsnapError as exc:
                out.append(f"sharding: {exc}")
    return out


def run(args: argparse.Namespace) -> int:
    if args.all:
        if args.step is not None:
            raise ConfigError(f"--all and --step {args.step}: pass one of them")
        store, _ = locate(args.location, args.endpoint)
        steps = store.steps()
    else:
        store, step, _ = open_step(args)
        steps = [step]
    bad = 0
    for step in steps:
        try:
            marker = store.marker(step)
        except FormatError as exc:
            bad += 1
            print(f"step {step}: DAMAGED\n  {printable(exc)}")
            continue
        problems = verify_step(store, step, marker)
        size = human(sum(r["bin_bytes"] for r in marker["ranks"]))
        if problems:
            bad += 1
            print(f"step {step}: DAMAGED")
            for p in problems:
                print(f"  {printable(p)}")
        else:
            print(f"step {step}: OK ({marker['world_size']} ranks, {size}, every checksum matches)")
    return DAMAGED if bad else 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("verify", help="check every checksum of a step", description=__doc__.split("\n")[0])
    add_location(ap)
    ap.add_argument("--all", action="store_true", help="verify every committed step")
    ap.set_defaults(func=run)
    return ap
