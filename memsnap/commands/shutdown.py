"""``memsnap shutdown JOB``: stop a job's coordinator and agents and free their RAM, after asking."""

from __future__ import annotations

import argparse
import sys

from memsnap.commands._cluster import add_address, connect, jobs, not_found
from memsnap.errors import ConfigError
from memsnap.localcluster import wait_for


def confirm(job: str, entry: dict, stdin=None, stdout=None) -> bool:
    """Ask on the terminal; without one (and without --yes) refuse, naming the fix."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if not stdin.isatty():
        raise ConfigError(f"not shutting down job {job!r} without confirmation: no terminal to ask on; pass --yes")
    stdout.write(
        f"Shut down memsnap job {job!r}: its coordinator and {len(entry['agents'])} agent(s), "
        "dropping every snapshot held in RAM (durable steps stay)? [y/N] "
    )
    stdout.flush()
    return stdin.readline().strip().lower() in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    connect(args)
    found = jobs()
    if args.job not in found:
        return not_found("shutdown", args.job, args, found)
    if not args.yes and not confirm(args.job, found[args.job]):
        print("not shut down")
        return 1
    from memsnap.rank import shutdown

    shutdown(args.job, timeout=args.timeout)
    try:  # the actors' names are released a moment after they exit
        wait_for(lambda: args.job not in jobs(), timeout=args.timeout, what=f"job {args.job!r}'s actors to exit")
    except TimeoutError:
        print(
            f"memsnap shutdown: job {args.job!r} still has {jobs().get(args.job)} after {args.timeout:.0f} s; "
            "run it again",
            file=sys.stderr,
        )
        return 1
    print(f"job {args.job!r} shut down: its agents, RAM and secret are gone")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser(
        "shutdown", help="stop a job's agents and free their RAM", description=__doc__.split("\n")[0]
    )
    ap.add_argument("job", metavar="JOB", help="the job name given to Snapshotter(job=...)")
    add_address(ap)
    ap.add_argument("--yes", "-y", action="store_true", help="do not ask first")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each agent to stop")
    ap.set_defaults(func=run)
    return ap
